"""Two "nodes" on this machine: two torchrun invocations (one process each) joined by a c10d
rendezvous on loopback, CPU, gloo. Each node hosts one SGLang engine; the iteration's prompts are
sharded over the two engines, the samples gathered back, and rank 0 broadcasts the new weights to
both engines over one group.

* colocated, learner PP2 across the nodes: the rank hosting engine 1 is also the last pipeline stage,
  so it sends its weight pieces to rank 0 while its engine receives the broadcast;
* separate, learner DP2, overlapped rollouts (``rollout.max_staleness: 1``, 2 iterations): each
  data-parallel rank trains on half of the prompts, every group whole (the trainer checks the split and
  the coverage every iteration and fails otherwise); both engines generate iteration 2's samples while
  the learner trains iteration 1, with the weights of version 0.

The first rollout of a run depends only on the initial weights and the seeds, which follow the
prompt, not the engine, nor whether rollouts overlap: it equals the single-engine, synchronous run's (the
shared ``e2e_run``, same settings).
In the colocated case engine 0's scheduler is killed as that rollout starts: both engines restart
(they share the weight group), engine 0 samples its shard again, and the rollout is still the
single-engine run's.
"""
import os
import re
import signal
import subprocess
import sys

import mlflow
import pytest

from sparse_rl_mega.train.tracking import default_tracking_uri
from tests.conftest import ROOT, write_test_config
from sparse_rl_mega.runtime.ports import free_port

ITERATIONS = 1


def _two_nodes(config, overrides, timeout=600, env=None):
    port = free_port()
    procs = []
    for _node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
                   str(ROOT / "tools" / "launch.py"), str(config), *[f"--set={o}" for o in overrides]]
        procs.append(subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\n[test] killed after {timeout} s"
        outputs.append((proc.returncode, out, err))
    return outputs


def _history(run_dir, key):
    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("e2e-test").experiment_id])
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_two_nodes_two_engines(placement, e2e_run, tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    config = write_test_config(tmp_path / "two_nodes.yaml", tiny_model_dir, run_dir)
    iterations = ITERATIONS if placement == "colocated" else 2
    learner = (["parallel.pipeline_model_parallel_size=2"] if placement == "colocated"
               else ["parallel.pipeline_model_parallel_size=1", "rollout.max_staleness=1"])
    overrides = ["parallel.nnodes=2", "parallel.nproc_per_node=1", *learner, "rollout.num_engines=2",
                 f"rollout.placement={placement}", "trainer.sync_method=broadcast", f"trainer.iterations={iterations}",
                 "checkpoint.save_interval=0"]
    # colocated: engine 0's scheduler is killed as the first rollout starts; with the broadcast sync both
    # engines restart, join a new weight group and get the current weights (version 0), engine 0 samples
    # its shard again: the rollout must still equal the single-engine run's (below)
    env = {"SPARSE_RL_MEGA_FAULT": "kill-engine@rollout:1"} if placement == "colocated" else None
    outputs = _two_nodes(config, overrides, env=env)
    for code, out, err in outputs:
        assert code == 0, out[-3000:] + err[-5000:]
    head_out = outputs[0][1] + outputs[1][1]
    assert f"[iter {iterations}/{iterations}]" in head_out
    # each stage's owner: its node's engine reads its shared buffers, the other node's engine receives its
    # broadcasts (colocated PP2: rank 0 and rank 1 each own a group; separate DP2: rank 0 owns the model)
    groups = 2 if placement == "colocated" else 1
    formed = 2 if placement == "colocated" else 1  # (again after the engines restarted, below)
    assert head_out.count("weight broadcast group of 2 members") == groups * formed, head_out[-3000:]
    # the groups of the engines before the restart are ended (destroyed) before the new ones form (the
    # log is rank 0's: the end of its own group)
    assert re.findall(r"weight broadcast group (\S+) ended", head_out) == ["sparse_rl_mega_weights_1_r0"] * (formed - 1)
    assert "members: rank 0's (gloo" in head_out and ("members: rank 1's (gloo" in head_out) == (placement == "colocated")
    if placement == "colocated":
        assert "[engine] engine 0 (on rank 0) failed in rollout: its scheduler process" in head_out
        assert "restarting every engine (they share the weight groups)" in head_out
        assert "[engine] every engine restarted and given weights version 0" in head_out
        # (processes forked from the rank's server again: rollout/forkserver.py)
        assert re.search(r"every engine restarted .*; forked from this process\)", head_out), head_out[-3000:]
        assert _history(run_dir, "engine/restarts") == {0: 1.0}

    steps = range(iterations)
    assert _history(run_dir, "rollout/engines") == {i: 2.0 for i in steps}
    # after every push both engines serve the learner's weights (the largest difference of the two)
    assert all(v < 1e-4 for v in _history(run_dir, "sync/max_abs_logprob_diff").values())
    assert _history(run_dir, "sync/weight_version") == {i: i + 1.0 for i in steps}
    if placement == "separate":  # iteration 2 trained on the samples both engines made during iteration 1
        assert _history(run_dir, "rollout/weight_version") == {0: 0.0, 1: 0.0}
        assert _history(run_dir, "rollout/staleness_max") == {0: 0.0, 1: 1.0}
        # the batch ahead was started before iteration 1's mismatch set the next budget: the first one
        assert _history(run_dir, "kv/budget") == {0: 12.0, 1: 12.0}
    dp_share = 4 if placement == "colocated" else 2  # 4 prompts per iteration over DP 1 or DP 2
    assert set(_history(run_dir, "rollout/prompts_per_dp_rank").values()) == {dp_share}

    # the first rollout, sharded over two engines, equals the single engine's
    single_dir, single = e2e_run
    assert single.returncode == 0
    for key in ("reward/mean", "rollout/response_len_mean", "kv/evicted_tokens"):
        assert _history(run_dir, key)[0] == _history(single_dir, key)[0], key
