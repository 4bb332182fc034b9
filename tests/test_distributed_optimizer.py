"""Megatron's distributed optimizer (Adam states sharded over data-parallel ranks, gradients
reduce-scattered, parameters all-gathered after the step; the GPU examples turn it on) trains exactly
like the replicated optimizer: two launches at DP2 (gloo) with the same seeds, compared step by step."""
import mlflow
import pytest

from sparse_rl_mega.tracking import default_tracking_uri
from tests.conftest import run_launch, write_test_config

KEYS = ["train/loss", "train/grad_norm", "train/entropy", "reward/mean", "mismatch/k3", "sync/max_abs_logprob_diff"]


def _metrics(run_dir):
    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("e2e-test").experiment_id])
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in KEYS}


def test_distributed_optimizer_equals_replicated(tiny_model_dir, tmp_path):
    results = {}
    for sharded in (False, True):
        run_dir = tmp_path / f"sharded-{sharded}"
        config = write_test_config(tmp_path / f"c-{sharded}.yaml", tiny_model_dir, run_dir)
        proc = run_launch(config, "--set=parallel.pipeline_model_parallel_size=1", "--set=trainer.iterations=2",
                          f"--set=parallel.use_distributed_optimizer={str(sharded).lower()}",
                          "--set=checkpoint.save_interval=0", timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        results[sharded] = _metrics(run_dir)
    plain, sharded = results[False], results[True]
    for key in KEYS:
        assert sorted(plain[key]) == sorted(sharded[key]) == [0, 1], key
    # iteration 1: same rollout and gradient; iteration 2 runs on the weights the two optimizers produced
    for step in (0, 1):
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert sharded[key][step] == pytest.approx(plain[key][step], rel=1e-5, abs=1e-7), (key, step)
        assert sharded["reward/mean"][step] == plain["reward/mean"][step]
        assert sharded["sync/max_abs_logprob_diff"][step] < 1e-4  # the engine got the all-gathered weights
