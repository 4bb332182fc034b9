"""Stop and resume: a run resumed from the checkpoint of iteration 2 computes the same iteration 3 as
the uninterrupted 3-iteration run (the shared ``e2e_run``): on the same layout (PP=2) bit for bit, even
with its engine's scheduler stopped (hung) as the weight push starts (the push times out, the engine
is restarted and given the weights: sparse_rl_mega/rollout/fleet.py); on
another one (TP=2 x CP=2, PP=1, 4 processes: each rank holds half the heads and two quarters of every
sequence; weights pushed by broadcast over a gloo group instead of in-process tensors) and as an
interleaved pipeline (PP=2 with 2 virtual stages: each rank holds layers {0, 2} or {1, 3}) to float32
summation order: same rollouts (the engine gets the checkpoint's weights), same loss and correction
(model and Adam moments restored, resharded by dist_checkpointing)."""
import re
import shutil
import sys
from pathlib import Path

import mlflow
import pytest

from sparse_rl_mega.train.tracking import default_tracking_uri
from tests.conftest import run_launch, write_test_config

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from float_bounds import U32, forward_depth, gamma

# Another layout sums in another order. The iteration's numbers come from one forward and backward pass
# of the tiny model (4 layers, hidden 64, ffn 128, head_dim 16, vocabulary 384) over 16 sequences of at
# most 9 + 24 positions: n = 2 x the forward depth + the tokens, and the float32 bound gamma_n (2.6e-4)
# holds relative to the values and, for values near 0 (loss, KL), absolutely (their terms are of order 1:
# normalised advantages times clipped ratios, log-ratios of one token)
RESHARD_BOUND = gamma(2 * forward_depth(4, 64, 128, 16, 33, 384) + 16 * 33, U32)

COMPARED = ["sync/max_abs_logprob_diff", "rollout/weight_version", "reward/mean", "rollout/response_len_mean", "kv/evicted_tokens",
            "kv/budget", "kv/peak_request_tokens", "mismatch/k3",
            "correction/token_rejected_fraction", "correction/is_weight_mean", "train/loss", "train/entropy",
            "train/grad_norm", "train/kl_ref"]


def _metrics_at(run_dir: Path, step: int, keys: list[str] = COMPARED) -> dict:
    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    experiment = client.get_experiment_by_name("e2e-test")
    (run,) = client.search_runs([experiment.experiment_id])
    out = {}
    for key in keys:
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        if step in history:
            out[key] = history[step]
    return out


def _check_chunked_checkpoint_exports(full_dir: Path, run_dir: Path, tmp_path: Path, model_dir: Path) -> None:
    """A checkpoint saved by model chunks loads into one unchunked model: its export equals the
    uninterrupted run's checkpoint (read independently of the tool) to float32 rounding of one
    differently summed step."""
    import json

    import torch

    from sparse_rl_mega.learner.weights import read_hf_state_dict
    from tests.conftest import ROOT, run_tool
    from tests.test_export_hf import independent_hf_weights

    done = run_tool(ROOT / "tools" / "export_hf.py", run_dir / "checkpoints" / "iter_0000003", "--out", tmp_path / "chunked",
                    timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    chunked = read_hf_state_dict(tmp_path / "chunked")
    uninterrupted = independent_hf_weights(full_dir / "checkpoints" / "iter_0000003",
                                           json.loads((model_dir / "config.json").read_text()), tmp_path)
    assert chunked.keys() == uninterrupted.keys()
    for key, want in uninterrupted.items():
        assert torch.allclose(chunked[key], want, rtol=0, atol=1e-5), key


@pytest.mark.parametrize("layout", ["same-pp2", "tp2-cp2", "pp2-vpp2"])
def test_resumed_iteration_equals_uninterrupted(e2e_run, tiny_model_dir, tmp_path, layout):
    full_dir, proc = e2e_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = full_dir / "checkpoints" / "iter_0000002"
    run_dir = tmp_path / "resumed"
    config = write_test_config(tmp_path / "resume.yaml", tiny_model_dir, run_dir)
    overrides = [f"--set=checkpoint.resume={checkpoint}"]
    if layout != "pp2-vpp2":  # that one's checkpoint (saved as model chunks) is exported below
        overrides.append("--set=checkpoint.save_interval=0")
    if layout == "tp2-cp2":  # heads split, sequences split for the learner's logprobs, reference logprobs and
        # loss, and the broadcast weight path: the engine joins a gloo group with rank 0
        overrides += ["--set=parallel.nproc_per_node=4", "--set=parallel.tensor_model_parallel_size=2",
                      "--set=parallel.context_parallel_size=2", "--set=parallel.pipeline_model_parallel_size=1",
                      "--set=trainer.sync_method=broadcast"]
    if layout == "pp2-vpp2":  # model chunks through checkpoint load, schedule, reference model and weight push
        overrides += ["--set=parallel.virtual_pipeline_model_parallel_size=2"]
    env = None
    if layout == "same-pp2":  # an engine failure on the way, which the iteration must not show: the scheduler is
        # stopped (hung) as the weight push starts (a killed one: tests/test_multinode.py)
        env = {"SPARSE_RL_MEGA_FAULT": "stop-engine@push:3"}
        overrides.append("--set=rollout.engine_timeout_s=4")
        # and --resume over a folder whose newest checkpoint is corrupt (one byte of a shard changed, its
        # size kept: only the digest can tell): it is skipped, iteration 2's is used
        for name in ("iter_0000002", "iter_0000003"):
            shutil.copytree(full_dir / "checkpoints" / name, run_dir / "checkpoints" / name)
        shard = run_dir / "checkpoints" / "iter_0000003" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        overrides = ["--resume" if o.startswith("--set=checkpoint.resume=") else o for o in overrides]
    resumed = run_launch(config, *overrides, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "Warning" not in resumed.stderr, resumed.stderr[-3000:]  # resuming is quiet too (sparse_rl_mega/runtime/quiet.py)
    assert "resumed from" in resumed.stdout and "[iter 3/3]" in resumed.stdout
    assert "[iter 1/3]" not in resumed.stdout and "[iter 2/3]" not in resumed.stdout
    if layout == "pp2-vpp2":
        assert "PP=2x2 virtual" in resumed.stdout
        _check_chunked_checkpoint_exports(full_dir, run_dir, tmp_path, tiny_model_dir)
    if layout == "tp2-cp2":
        assert "TP=2 PP=1 CP=2 DP=1" in resumed.stdout

    expected, got = _metrics_at(full_dir, 2), _metrics_at(run_dir, 2)
    assert set(got) == set(expected) == set(COMPARED)
    # the rollout is the same (engine weights equal bit for bit, same seeds)
    for key in ("reward/mean", "rollout/response_len_mean", "kv/evicted_tokens"):
        assert got[key] == expected[key], (key, got[key], expected[key])
    # the engine served the pushed weights: the version of the iteration they come from, and the learner's
    # logprobs after the sync
    assert got["rollout/weight_version"] == expected["rollout/weight_version"] == 2
    assert got["sync/max_abs_logprob_diff"] < 1e-4
    if layout == "same-pp2":  # same layout, same summation order: bit for bit, despite the engine restart
        assert (f"[setup] checkpoint iter_0000003 skipped: it does not verify: {shard}: XXH3 digest "
                in resumed.stdout), resumed.stdout[-3000:]
        assert f"resumed from {run_dir / 'checkpoints' / 'iter_0000002'} (iteration 2 of MLflow run " in resumed.stdout
        assert "[engine] engine 0 (on rank 0) failed in weight push: no answer for" in resumed.stdout
        assert "rollout.engine_timeout_s=4); its scheduler" in resumed.stdout and "is stopped" in resumed.stdout
        assert resumed.stdout.count("restarted and given weights version 3") == 1
        assert re.search(r"restarted and given .*; forked from this process\)", resumed.stdout)  # (rollout/forkserver.py)
        # (at least: on a busy machine a 4-s silence in the rollout is a hang too, by this config)
        assert _metrics_at(run_dir, 2, ["engine/restarts"])["engine/restarts"] >= 1.0
        assert got == expected
        return
    # the learner's numbers agree to float32 summation order (a different layout sums differently)
    for key in COMPARED[2:]:
        assert got[key] == pytest.approx(expected[key], rel=RESHARD_BOUND, abs=RESHARD_BOUND), (key, got[key], expected[key])


def test_full_disk_during_a_checkpoint_then_the_restart_continues_exactly(e2e_run, tiny_model_dir, tmp_path):
    """A launch with --overwrite into a folder that holds an earlier run (removed first), whose rank 0
    checkpoint writer fails with the operating system's ENOSPC while it writes iteration 2's shards (the
    fault module raises it inside Megatron's writer, as a full disk does): one line for the job naming the
    folder, the cause and the free space; the partial folder is removed, iteration 1's checkpoint kept;
    the launcher's restart resumes from it. There rank 1 is stopped (SIGSTOP) as it trains iteration 3:
    the watchdog names it within its bound (at least trainer.watchdog_floor_s=8, 5 x the longest
    iteration) and stops the job; the second restart resumes from iteration 2's checkpoint and iteration 3 equals
    the uninterrupted run's bit for bit."""
    from sparse_rl_mega.runtime.checkpoint_files import complete_checkpoints, verify

    full_dir, _ = e2e_run
    run_dir = tmp_path / "run"
    stray = run_dir / "checkpoints" / "iter_0000009"  # another run's checkpoint, and its records
    stray.mkdir(parents=True)
    (run_dir / "timeline.jsonl").write_text("{}\n")
    config = write_test_config(tmp_path / "disk.yaml", tiny_model_dir, run_dir)
    done = run_launch(config, "--overwrite", "--max-restarts", "2", "--set=trainer.watchdog_floor_s=8", timeout=600,
                      env={"SPARSE_RL_MEGA_FAULT": "full-disk@checkpoint:2,stop-rank1@train:3"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert f"[launch] --overwrite: removed checkpoints iter_0000009 in {run_dir / 'checkpoints'}; timeline.jsonl" \
        in done.stdout, done.stdout[:3000]
    errors = [line for line in done.stderr.splitlines() if line.startswith("[error]")]
    folder = run_dir / "checkpoints"
    assert len(errors) == 1 and errors[0].startswith(
        f"[error] rank 0: checkpoint of iteration 2 not saved: {folder / 'iter_0000002'}: No space left on device "
        f"(errno ENOSPC) ("), errors
    assert (f"free); the partial iter_0000002 was removed; the newest complete checkpoint is {folder / 'iter_0000001'}"
            in errors[0]), errors
    assert "Traceback" not in done.stderr and "encountered an error" not in done.stderr, done.stderr[-3000:]
    assert "[launch] the job failed: rank" in done.stderr and "starting it again from the newest checkpoint" in done.stderr
    assert f"resumed from {folder / 'iter_0000001'} (iteration 1 of MLflow run " in done.stdout
    (found,) = [line for line in done.stderr.splitlines() if line.startswith("[watchdog]")]
    quiet, bound, stopped_for = re.match(  # (stopped after iteration 3's rollout: in its own phase or between two)
        r"\[watchdog\] no rank has made progress for (\d+) s \(bound (\d+) s: [^)]+, rank \d\): rank 1 \(host \S+, "
        r"pid \d+\) has not run for (\d+) s \(its process is stopped or frozen\), in phase \w+ of iteration 3; "
        r"stopping the job$", found).groups()
    assert 8 <= int(bound) <= int(quiet) <= int(bound) + 3 and int(stopped_for) <= int(bound) + 3, found
    assert "[launch] the job was stopped by its watchdog (the [watchdog] line above names the rank); starting it " \
           "again" in done.stderr
    assert f"resumed from {folder / 'iter_0000002'} (iteration 2 of MLflow run " in done.stdout
    assert [p.name for p in complete_checkpoints(folder)] == ["iter_0000002", "iter_0000003"]  # keep_last 2
    assert all(verify(p) is None for p in complete_checkpoints(folder))
    assert _metrics_at(run_dir, 2) == _metrics_at(full_dir, 2)
