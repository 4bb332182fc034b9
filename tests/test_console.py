"""What the console says where things went: the ETA and totals, the MLflow run's name and how to open
it, what --resume would continue from after a stop, and SGLang's loading bars only where they measure
progress. (The lines themselves, in a run: tests/test_e2e.py reads a launch's output.)"""
import json

import pytest

from sparse_rl_mega.config import load_config
from tests.conftest import ROOT

CPU_TINY = ROOT / "examples" / "cpu_tiny.yaml"


@pytest.mark.parametrize("seconds, text", [(0.4, "0 s"), (59.4, "59 s"), (59.6, "1m 00s"), (185, "3m 05s"),
                                           (3599, "59m 59s"), (7380, "2h 03m")])
def test_durations_read_as_a_person_would_say_them(seconds, text):
    from sparse_rl_mega.train.console import duration

    assert duration(seconds) == text


def test_mlflow_run_is_named_after_what_ran_and_says_how_to_open_it(tmp_path, monkeypatch):
    from sparse_rl_mega.train.tracking import Tracker, default_run_name

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_run_name(load_config(CPU_TINY)) == "cpu_tiny-rkv12-sparse_rl"
    dense = load_config(CPU_TINY, ["rollout.kv_compression.policy=none", "algorithm.correction.preset=naive"])
    assert default_run_name(dense) == "cpu_tiny-dense-naive"
    cfg = load_config(CPU_TINY, [f"trainer.run_dir={tmp_path / 'run'}"])
    tracker = Tracker(cfg)
    try:
        assert tracker.run_name == "cpu_tiny-rkv12-sparse_rl"
        assert tracker.how_to_open() == (f"MLflow run 'cpu_tiny-rkv12-sparse_rl': make -C {ROOT} mlflow-ui "
                                         f"RUN={tmp_path / 'run'}, then open http://127.0.0.1:5000")
    finally:
        tracker.finish()
    monkeypatch.chdir(ROOT)  # from the repository: the folder as make takes it, relative
    relative = load_config(CPU_TINY, ["trainer.run_dir=runs/test-console-name", "tracking.run_name=mine"])
    tracker = Tracker(relative, enabled=False)
    tracker.run_dir, tracker.run_name, tracker.tracking_uri = (ROOT / "runs" / "test-console-name", "mine",
                                                               f"sqlite:///{ROOT / 'runs' / 'test-console-name' / 'mlflow.db'}")
    assert tracker.how_to_open() == ("MLflow run 'mine': make mlflow-ui RUN=runs/test-console-name, then open "
                                     "http://127.0.0.1:5000")
    tracker.tracking_uri = "http://tracking:5000"
    tracker.run_id = "abc"
    assert tracker.how_to_open() == "MLflow run 'mine' (abc) at http://tracking:5000"


def test_the_stop_line_names_the_checkpoint_resume_would_use(tmp_path):
    from sparse_rl_mega.cli.describe import resume_hint

    from sparse_rl_mega.runtime.checkpoint_files import MARKER

    cfg = load_config(CPU_TINY, [f"trainer.run_dir={tmp_path}"])
    folder = tmp_path / "checkpoints"
    assert resume_hint(cfg) == (f"no checkpoint under {folder} (the first is due after iteration 5): --resume would "
                                "start from the beginning")
    assert "(checkpoint.save_interval is 0)" in resume_hint(load_config(CPU_TINY, [f"trainer.run_dir={tmp_path}",
                                                                                     "checkpoint.save_interval=0"]))
    for iteration in (5, 10):
        (folder / f"iter_{iteration:07d}").mkdir(parents=True)
    (folder / "iter_0000005" / MARKER).write_text(json.dumps({"iteration": 5}))  # iteration 10: not complete
    assert resume_hint(cfg) == f"--resume continues from {folder / 'iter_0000005'}"


@pytest.mark.parametrize("shards, drawn", [(1, False), (2, True)])
def test_sglang_draws_a_loading_bar_only_over_several_shards(shards, drawn, capsys, monkeypatch):
    import threading

    from tqdm.std import tqdm

    from sglang_patches.loading_bar import _BarOverShards

    # a thread lock for the bars: tqdm's default makes a multiprocessing one, registered with this
    # worker's resource tracker (which SGLang's engine processes avoid: rollout/forkserver.py)
    monkeypatch.setattr(tqdm, "_lock", threading.RLock(), raising=False)

    files = [f"model-{i}.safetensors" for i in range(shards)]
    assert list(_BarOverShards(files, desc="Loading safetensors checkpoint shards")) == files
    with _BarOverShards(total=shards, desc="Multi-thread loading shards",
                        position=_BarOverShards._get_free_pos()) as bar:
        bar.update(shards)
    assert ("Multi-thread loading shards" in capsys.readouterr().err) == drawn


def test_a_dense_sampler_mismatch_above_rounding_is_warned_of():
    """The warning that would have caught the learner ignoring the sampling temperature: iteration 1 of
    the dense tiny run at temperature 0.6 showed k3 0.0132 (docs/algorithm.md); the float32 rounding of
    an engine and the learner with the same weights explains at most exp(tau) - 1 - tau with
    tau = 1e-4 / 0.6, 1.4e-8. Compressed rollouts (no metric) and k3 within the bound say nothing."""
    from sparse_rl_mega.train.step_metrics import dense_k3_bound, dense_mismatch_warning

    rollout = load_config(CPU_TINY, ["rollout.temperature=0.6", "rollout.top_k=5"]).rollout
    tau = 1e-4 / 0.6
    assert dense_k3_bound("float32", 0.6) == pytest.approx(tau ** 2 / 2, rel=1e-3)
    assert dense_k3_bound("bfloat16", 1.0) == pytest.approx(0.02 ** 2 / 2, rel=0.02)
    warning = dense_mismatch_warning(0, {"mismatch/dense_sampler_k3": 0.0132}, "float32", rollout)
    assert warning.startswith("[warn] iteration 1: dense rollouts differ from the learner's old policy by k3 1.32e-02")
    assert "(1.4e-08 at temperature 0.6)" in warning and "top_k 5" in warning
    assert dense_mismatch_warning(0, {"mismatch/dense_sampler_k3": 1e-8}, "float32", rollout) is None
    assert dense_mismatch_warning(0, {"mismatch/k3": 0.5}, "float32", rollout) is None
