"""An engine whose TP differs from the learner's: SGLang's CPU engine at TP2 (two scheduler ranks,
each holding half the heads) fed by a learner at TP1 x PP2 over the broadcast path (a gloo group of
the learner's rank 0 and both engine ranks). After every sync the engine's dense logprobs equal the
learner's; KV eviction runs on both engine ranks."""
import mlflow

from sparse_rl_mega.tracking import default_tracking_uri
from tests.conftest import run_launch, write_test_config


def test_learner_pp2_to_engine_tp2_by_broadcast(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = write_test_config(tmp_path / "engine_tp2.yaml", tiny_model_dir, run_dir)
    proc = run_launch(config, "--set=trainer.iterations=2", "--set=rollout.engine_tensor_parallel_size=2",
                      "--set=trainer.sync_method=broadcast", "--set=checkpoint.save_interval=0",
                      "--set=algorithm.kl_coef=0.0", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("e2e-test").experiment_id])

    def history(key):
        return [m.value for m in client.get_metric_history(run.info.run_id, key)]

    assert all(v < 1e-4 for v in history("sync/max_abs_logprob_diff")), history("sync/max_abs_logprob_diff")
    assert all(v > 1e-3 for v in history("sync/pre_sync_max_abs_logprob_diff"))
    assert history("sync/weight_version") == [1.0, 2.0]
    assert all(v > 0 for v in history("kv/evicted_tokens"))
