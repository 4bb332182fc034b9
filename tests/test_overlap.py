"""Overlapped rollouts (``rollout.max_staleness``, sparse_rl_mega/rollout/overlap.py) on the tiny model:
one learner rank and one separate engine, dense sampling (so that any gap between the sampler's
``logp_sparse`` and the learner's ``logp_old`` comes from staleness alone), 5 iterations.

* K = 1: iteration i >= 2 trains on samples of weights i-1, the learner's dense ``logp_old`` is of
  its current weights (the mismatch of those rows is far above the staleness-0 rows' float noise), and
  the engine decodes the next batch while the learner trains (``timeline.jsonl``). (That the first
  iteration equals the synchronous run's is checked by tests/test_multinode.py with two engines; how
  K = 1 learns beside K = 0 over 12-20 iterations is measured by tools/bench_overlap.py,
  docs/benchmarks.md: the tiny task learns too little in 5 iterations to tell.)
* K = 1 with rank 0 SIGKILLed while it trains iteration 3 (a batch in flight), restarted by the
  launcher from iteration 2's checkpoint (which holds the batch ahead): every metric of iterations
  1-4 and every tensor of iteration 4's checkpoint equal the uninterrupted K = 1 run's. Then the
  engine is SIGKILLed while it generates iteration 5's batch during iteration 4's training: it is
  restarted with the learner's newest weights and samples that batch again, which is then fresh
  (staleness 0) where the uninterrupted run's was one version old. The run logs to a real ``mlflow
  server`` that is killed as iteration 4's rollout starts (after the restart) and started again 5 s later:
  training goes on meanwhile, the values logged while it was down are sent when it answers, and none is
  missing (chaos compares every metric of every iteration).

The uninterrupted run is made by ``tools/bench_overlap.py --staleness 1`` and the faulted one by
``tools/chaos.py --fault ... --reference`` (each tool's smallest real use, at no extra launch).
"""
import json
import re
from types import SimpleNamespace

import pytest

from sparse_rl_mega.train.step_metrics import dense_k3_bound
from tests.conftest import ROOT, run_tool, write_test_config
from sparse_rl_mega.studies.overlap import SEPARATE
from sparse_rl_mega.train.run_records import compare, final_state, metrics_by_iteration

ITERATIONS = 5
# on top of bench_overlap's SEPARATE layout (one learner rank, one separate engine, broadcast)
# dense rollouts sampled at temperature 0.6 with top-k 5 and top-p 0.7: every learner pass (old policy,
# training, reference) must reproduce that distribution, and the batch ahead carries its supports
# through a checkpoint
OVERRIDES = ["rollout.kv_compression.policy=none", "checkpoint.save_interval=2", "checkpoint.keep_last=3",
             "rollout.max_staleness=1", "rollout.temperature=0.6", "rollout.top_k=5", "rollout.top_p=0.7"]


@pytest.fixture(scope="module")
def overlap_config(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("overlap")
    return write_test_config(work / "overlap.yaml", tiny_model_dir, work / "unused")


@pytest.fixture(scope="module")
def overlapped(overlap_config):
    """K = 1, uninterrupted, as ``tools/bench_overlap.py`` runs it: (run folder, its launch's output)."""
    out = overlap_config.parent / "bench"
    proc = run_tool(ROOT / "tools" / "bench_overlap.py", overlap_config, "--staleness", "1",
                    "--iterations", ITERATIONS, "--out", out, "--json", out / "bench.json",
                    *[f"--set={o}" for o in OVERRIDES], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    figures = json.loads((out / "bench.json").read_text())["figures"]["1"]
    assert figures["iterations_timed"] == ITERATIONS - 1 and figures["staleness_mean"] == 1.0, figures
    assert "k1_iteration_s=" in proc.stdout
    return out / "k1_r0", SimpleNamespace(stdout=(out / "k1_r0.log").read_text())


def test_samples_are_one_version_old_and_corrected_against_current_weights(overlapped):
    run_dir, proc = overlapped
    metrics = metrics_by_iteration(run_dir)
    assert [metrics[i]["rollout/weight_version"] for i in range(ITERATIONS)] == [0, 0, 1, 2, 3]
    assert [metrics[i]["rollout/staleness_max"] for i in range(ITERATIONS)] == [0, 1, 1, 1, 1]
    assert all(metrics[i]["rollout/stale_dropped_samples"] == 0 for i in range(ITERATIONS))
    assert [metrics[i]["sync/weight_version"] for i in range(ITERATIONS)] == [1, 2, 3, 4, 5]  # a push every iteration
    # dense sampler: fresh samples match the learner's old policy to float rounding at the sampling
    # temperature over the truncation's supports (step_metrics.dense_k3_bound: k3 <= exp(tau) - 1 - tau,
    # tau = 1e-4 / 0.6), so nothing is rejected; one-version-old samples differ by what one iteration of
    # training changed, measured against the learner's current weights
    assert metrics[0]["mismatch/dense_sampler_k3"] == metrics[0]["mismatch/k3_staleness0"]
    assert metrics[0]["mismatch/dense_sampler_k3"] <= dense_k3_bound("float32", 0.6), metrics[0]
    assert metrics[0]["correction/token_rejected_fraction"] == metrics[0]["correction/veto_fraction"] == 0
    assert "[warn]" not in proc.stdout
    for i in range(1, ITERATIONS):
        assert "mismatch/k3_staleness0" not in metrics[i] and "mismatch/dense_sampler_k3" not in metrics[i]
        assert metrics[i]["mismatch/k3_staleness1"] > 1e-4, metrics[i]
    assert "(samples 1.0 versions old" in proc.stdout


def test_engine_decodes_while_the_learner_trains(overlapped):
    """Every batch ahead starts before the learner's forward pass and is decoded while the learner
    computes. One iteration in four may show no overlap: in two of five clean-clone suites of
    2026-12-07 (the other worker running another launch) the first iteration's learner began its
    forward pass as the engine finished the next batch (its CPU affinity and priority are those of the
    engine's processes; the cause is not known); every other iteration overlapped."""
    run_dir, _ = overlapped
    rows = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == list(range(ITERATIONS))
    overlaps = []
    for row in rows[:-1]:  # the last iteration starts nothing ahead
        (gen,) = [g for g in row["engines"] if g["batch"] == row["iteration"] + 1]
        learner = [(start, end) for name, start, end in row["learner"] if name in ("logp_old", "train")]
        busy_start, busy_end = min(s for s, _ in learner), max(e for _, e in learner)
        assert gen["start"] < busy_start  # started before the learner's forward pass
        overlaps.append(min(gen["end"], busy_end) - max(gen["start"], busy_start))
    assert sum(overlap > 0.05 for overlap in overlaps) >= len(overlaps) - 1, overlaps


def test_killed_mid_overlap_resumes_exactly(overlapped, overlap_config):
    """One chaos trial with both faults against the uninterrupted run: chaos reports the one documented
    difference (iteration 5's batch is fresh), nothing else, and no process left behind."""
    run_dir, _ = overlapped
    out = overlap_config.parent / "chaos"
    faults = "kill-rank0@train:3+0.1,kill-engine@train:4+0.05,kill-tracking@rollout:4+0"
    done = run_tool(ROOT / "tools" / "chaos.py", overlap_config, "--reference", run_dir,
                    "--fault", faults, "--out", out, *[f"--set={o}" for o in SEPARATE + OVERRIDES],
                    f"--set=trainer.iterations={ITERATIONS}", timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # (iteration 5 differs, by design)
    (verdict,) = [line for line in done.stdout.splitlines() if line.startswith("[chaos] trial 1/1")]
    assert f"trial 1/1 {faults}" in verdict and "job restarted by the launcher" in verdict, verdict
    assert "processes left" not in verdict and "did not fire" not in verdict, verdict
    killed_dir = out / "trial01"
    proc = SimpleNamespace(stdout=(out / "trial01.log").read_text())
    assert "[launch] the job failed: rank 0 was killed by SIGKILL" in proc.stdout
    assert "resumed from" in proc.stdout
    uninterrupted, resumed = metrics_by_iteration(run_dir), metrics_by_iteration(killed_dir)
    differences = compare((final_state(run_dir, 4), {i: uninterrupted[i] for i in range(4)}),
                          (final_state(killed_dir, 4), resumed))
    assert not differences, differences
    # the engine killed while generating ahead: restarted with weights 4, iteration 5's batch sampled again
    assert "[engine] engine 0 (on rank 0) failed in rollout: its scheduler process" in proc.stdout
    assert "[engine] every engine restarted and given weights version 4" in proc.stdout  # (they share the weight groups)
    assert re.search(r"every engine restarted .*; forked from this process\)", proc.stdout)  # (rollout/forkserver.py)
    assert (resumed[4]["rollout/weight_version"], resumed[4]["rollout/staleness_max"]) == (4, 0)
    # the tracking server killed at iteration 4 and started again: the values waited and were sent late
    # (the first failed request: refused, or one cut as the server died)
    assert re.search(r"\[tracking\] the MLflow store http://127.0.0.1:\d+ does not take metrics \(\S.*\): training "
                     r"goes on", proc.stdout), proc.stdout[-3000:]
    assert re.search(r"\[tracking\] the MLflow store http://127.0.0.1:\d+ answers again after \d+ s: sent \d+ values "
                     r"of steps? \d", proc.stdout), proc.stdout[-3000:]
    assert uninterrupted[4]["rollout/weight_version"] == 3


def test_partial_rollouts_pause_requests_across_pushes(overlap_config):
    """Partial rollouts with R-KV, each KV choice (``tools/bench_overlap.py --staleness 1:stale,1:reprefill``,
    the tool's smallest real use): the engine decodes one request at a time, so requests are in flight
    at every push. They are paused, the weights pushed, and they resume: samples span two versions, no
    token is more than one version old, the resumed tokens' mismatch is measured, and every iteration
    trains on its own prompts (the batch after next started at the push)."""
    out = overlap_config.parent / "partial"
    proc = run_tool(ROOT / "tools" / "bench_overlap.py", overlap_config, "--staleness", "1:stale,1:reprefill",
                    "--iterations", 4, "--out", out, "--json", out / "bench.json", "--set=rollout.max_running_requests=1",
                    timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ratio_samples_per_s_k1:reprefill_over_k1:stale=" in proc.stdout
    for name in ("k1-stale_r0", "k1-reprefill_r0"):
        metrics = metrics_by_iteration(out / name)
        assert sorted(metrics) == [0, 1, 2, 3]
        for m in metrics.values():  # ages 0 and 1 only
            assert m["rollout/token_age0_fraction"] + m["rollout/token_age1_fraction"] == pytest.approx(1.0)
            assert m["rollout/staleness_max"] <= 1 and m["rollout/stale_dropped_samples"] == 0
        assert sum(metrics[i]["sync/paused_generations"] for i in range(3)) >= 2, name
        mixed = [i for i in metrics if metrics[i]["rollout/multi_version_fraction"] > 0]
        assert mixed and all("mismatch/k3_resumed" in metrics[i] for i in mixed), (name, mixed)
        assert "[warn]" not in (out / f"{name}.log").read_text()


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 2, 3])
def test_push_schedule_bounds_staleness_by_k(k):
    """The push rule (``Cadence.push``) over a long run: batch j starts at iteration j-1 with the
    weights the engines serve then and trains at iteration j; no batch may be more than K versions old,
    and the engines get weights only as often as that needs (every K-th iteration)."""
    from sparse_rl_mega.train.cadence import Cadence

    schedule = Cadence(iterations=30, max_staleness=k, engines_release_memory=False)
    served, started_with, pushes = 0, {0: 0}, []
    for iteration in range(30):
        started_with[iteration + 1] = served  # start_ahead after take: the engines' weights now
        if schedule.push(iteration + 1, served):
            served = iteration + 1
            pushes.append(iteration + 1)
    staleness = [j - started_with[j] for j in range(1, 30)]
    assert max(staleness) == k and min(staleness) == 1
    assert pushes == list(range(k, 31, k))
    # colocated engines on GPUs hold no weights after training: a push after every iteration
    colocated = Cadence(iterations=30, max_staleness=k, engines_release_memory=True)
    assert all(colocated.push(t, t - 1) for t in range(1, 30))


@pytest.mark.unit
def test_a_sample_spanning_two_versions_is_aged_and_measured_per_token():
    """Partial rollouts: a sample paused by a push has tokens of two versions. Packed, each label keeps
    its own version and the row's version is its oldest; the batch's token ages and the mismatch of the
    resumed tokens (``mismatch/k3_resumed``) are computed over exactly those tokens, each with its own
    behaviour logprob (here: log ratio 0.5 on the two resumed tokens, 0.1 on the others)."""
    import math

    import torch

    from sparse_rl_mega.batch import GeneratedSample, pack_samples
    from sparse_rl_mega.rollout.overlap import token_ages
    from sparse_rl_mega.train.step_metrics import metrics_by_staleness

    paused = GeneratedSample(0, [1, 2, 3], [7, 8, 9, 10], [-1.0, -1.1, -1.2, -1.3], "", "stop", weight_version="4",
                             token_versions=[3, 3, 4, 4])
    whole = GeneratedSample(0, [1, 2], [5, 6], [-0.5, -0.6], "", "stop", weight_version="3", token_versions=[3, 3])
    batch = pack_samples([paused, whole], [1.0, 0.0])
    assert batch.token_versions[0].tolist() == [0, 0, 3, 3, 4, 4] and batch.token_versions[1].tolist()[1:3] == [3, 3]
    assert batch.weight_versions.tolist() == [3, 3]
    # trained at iteration 4: two tokens fresh, four one version old
    assert token_ages(batch, 4, 1) == {"rollout/token_staleness_mean": 4 / 6, "rollout/token_age0_fraction": 2 / 6,
                                       "rollout/token_age1_fraction": 4 / 6}
    resumed = batch.token_versions > batch.weight_versions[:, None]
    batch.logp_old = batch.logp_sparse + batch.response_mask * torch.where(resumed, 0.5, 0.1)
    metrics = metrics_by_staleness(batch, 4, 1, "sparse_rl", None)
    assert metrics["mismatch/k3_resumed"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)
    assert metrics["mismatch/k3_staleness0"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)
    assert metrics["mismatch/k3_staleness1"] == pytest.approx(math.exp(0.1) - 1.1, rel=1e-6)
