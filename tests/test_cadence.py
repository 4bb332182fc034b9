"""The iteration's timing (sparse_rl_mega/train/cadence.py: pushes, checkpoints, evaluations from one rule)
and the merge of the optimizer steps' metrics by their declared reductions (sparse_rl_mega/train/step_metrics.py).
The push rule's bound on staleness over a long run: tests/test_overlap.py."""
from __future__ import annotations

import pytest
import torch

from sparse_rl_mega.config import load_config
from sparse_rl_mega.train.cadence import Cadence
from sparse_rl_mega.train.step_metrics import STEP_REDUCTIONS, merge_steps, reduction
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def test_checkpoints_and_evaluations_fall_on_their_intervals_and_the_last_iteration():
    s = Cadence(iterations=10, save_interval=4, evaluating=True, eval_interval=3, eval_before_training=True)
    assert [t for t in range(1, 11) if s.checkpoint(t)] == [4, 8]
    assert [t for t in range(1, 11) if s.evaluate(t)] == [3, 6, 9, 10]
    assert [t for t in range(1, 11) if s.last(t)] == [10]
    assert s.evaluate_before_training(0) and not s.evaluate_before_training(5)  # (not when resuming)
    quiet = Cadence(iterations=10)  # no checkpoints, no held-out set
    assert not any(quiet.checkpoint(t) or quiet.evaluate(t) for t in range(1, 11))
    assert not quiet.evaluate_before_training(0)
    assert [t for t in range(1, 11) if Cadence(10, evaluating=True).evaluate(t)] == [10]  # interval 0


def test_engines_get_the_newest_weights_before_checkpoints_evaluations_and_the_end():
    # K = 3 alone pushes after iterations 3, 6, 9 (engines serving the weights pushed last)
    s = Cadence(iterations=10, max_staleness=3, save_interval=4, evaluating=True, eval_interval=5)
    served, pushes = 0, []
    for trained in range(1, 11):
        if s.push(trained, served):
            served = trained
            pushes.append(trained)
    assert pushes == [3, 4, 5, 8, 10]  # 3 (staleness), 4 (checkpoint), 5 (evaluation), 8 (both), 10 (last)
    assert all(Cadence(iterations=10).push(t, t - 1) for t in range(1, 11))  # K = 0: after every iteration


def test_partial_rollouts_wait_for_the_batch_ahead_before_checkpoints_evaluations_and_the_end():
    """With partial rollouts a push pauses what is in flight, except the pushes after which a
    checkpoint saves the batch ahead whole (no partial request in a checkpoint), an evaluation uses the
    engines, or training ends."""
    s = Cadence(iterations=10, max_staleness=1, save_interval=4, evaluating=True, eval_interval=5)
    assert [t for t in range(1, 11) if s.needs_complete_batch(t)] == [4, 5, 8, 10]
    assert [t for t in range(1, 11) if Cadence(iterations=10, max_staleness=1).needs_complete_batch(t)] == [10]


def test_cadence_reads_the_config():
    cfg = load_config(ROOT / "examples" / "cpu_tiny.yaml", ["trainer.iterations=10", "checkpoint.save_interval=5"])
    s = Cadence.from_config(cfg, engines_release_memory=False)
    assert (s.iterations, s.max_staleness, s.save_interval, s.evaluating) == (10, cfg.rollout.max_staleness, 5,
                                                                              cfg.eval.path is not None)
    assert [t for t in range(1, 11) if s.checkpoint(t)] == [5, 10]


def test_step_metrics_merge_by_their_declared_reductions():
    steps = [{"train/loss": 1.0, "train/skipped_steps": 1.0, "advantage/max": 2.0, "advantage/min": -1.0,
              "correction/is_weight_max": 3.0, "correction/is_weight_mean": 1.0, "mismatch/k3_staleness1": 0.5},
             {"train/loss": 2.0, "train/skipped_steps": 1.0, "advantage/max": 1.0, "advantage/min": -3.0,
              "correction/is_weight_max": 4.0, "correction/is_weight_mean": 2.0, "mismatch/k3_staleness0": 0.25}]
    merged = merge_steps(steps)
    assert merged == {"train/loss": 1.5, "train/skipped_steps": 2.0, "advantage/max": 2.0, "advantage/min": -3.0,
                      "correction/is_weight_max": 4.0, "correction/is_weight_mean": 1.5,
                      "mismatch/k3_staleness1": 0.5,  # a staleness present in one step: that step's value
                      "mismatch/k3_staleness0": 0.25}
    assert list(merged) == list(dict.fromkeys(key for m in steps for key in m))  # the steps' key order
    assert reduction("correction/veto_fraction_staleness2") == STEP_REDUCTIONS["correction/veto_fraction"]
    with pytest.raises(KeyError, match="no declared reduction"):
        merge_steps([{"train/new_figure": 1.0}])


def test_every_metric_a_step_reports_has_a_declared_reduction():
    """The correction's and the advantages' keys, whatever the preset (the train step's: every launch)."""
    from sparse_rl_mega.algo.correction import compute_correction
    from sparse_rl_mega.config import CorrectionConfig
    from sparse_rl_mega.train.step_metrics import advantage_metrics

    torch.manual_seed(0)
    logp_old, logp_sparse = -torch.rand(4, 6), -torch.rand(4, 6)
    mask = torch.ones(4, 6)
    for preset in ("sparse_rl", "tis", "icepop", "naive", "bypass"):
        _, _, metrics = compute_correction(logp_old, logp_sparse, mask, CorrectionConfig.from_preset(preset))
        assert all(key in STEP_REDUCTIONS for key in metrics), sorted(set(metrics) - set(STEP_REDUCTIONS))
    assert all(key in STEP_REDUCTIONS for key in advantage_metrics(torch.randn(8), None))
