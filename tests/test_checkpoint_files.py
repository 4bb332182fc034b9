"""What a checkpoint's marker records and what is done with it, without a learner: verification of
every file (size, XXH3-64 digest), the storage error's cause in the operating system's words, the free-space
check before a save, which checkpoints pruning keeps, which one --resume would take, and a run folder
that holds an earlier run. (The save and resume themselves: tests/test_resume.py.)"""
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import xxhash

from sparse_rl_mega.learner import checkpoint as saving
from sparse_rl_mega.runtime import checkpoint_files as ck


def _checkpoint(root: Path, iteration: int, files: dict[str, bytes], record: bool = True) -> Path:
    """A checkpoint folder with ``files`` and a marker recording them (digests computed here, whole)."""
    path = root / f"iter_{iteration:07d}"
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    marker = {"iteration": iteration}
    if record:
        marker["files"] = {name: [len(data), xxhash.xxh3_64_hexdigest(data)] for name, data in files.items()}
    (path / ck.MARKER).write_text(json.dumps(marker))
    return path


FILES = {"__0_0.distcp": b"a" * 1000 + b"b" * 1000, "rng/rank_0.pt": b"rng", "common.pt": b"common"}


def test_verify_names_the_file_and_what_differs(tmp_path):
    path = _checkpoint(tmp_path, 1, FILES)
    assert ck.verify(path) is None
    shard = path / "__0_0.distcp"
    shard.write_bytes(b"a" * 1000 + b"c" + b"b" * 999)  # same size, one byte changed
    assert ck.verify(path, full=False) is None
    assert ck.verify(path) == f"{shard}: XXH3 digest {xxhash.xxh3_64_hexdigest(shard.read_bytes())}, the marker " \
                              f"records {xxhash.xxh3_64_hexdigest(FILES['__0_0.distcp'])}"
    os.truncate(shard, 700)
    assert ck.verify(path, full=False) == f"{shard}: 700 bytes, the marker records 2000"
    (path / "rng" / "rank_0.pt").unlink()
    # the ranks split the files: each share reports only its own
    names = sorted(FILES)
    assert [ck.verify(path, share=(i, 3)) is not None for i in range(3)] == [n in ("__0_0.distcp", "rng/rank_0.pt")
                                                                          for n in names]
    assert ck.verify(path, share=(2, 3)) == f"{path / 'rng/rank_0.pt'}: missing"
    (path / ck.MARKER).write_text("{not json")
    assert ck.verify(path).startswith(f"{path / ck.MARKER}: unreadable (")
    old = _checkpoint(tmp_path, 2, FILES, record=False)  # saved before files were recorded: its marker suffices
    assert ck.verify(old) is None


def test_the_digest_is_xxh3_of_the_whole_file(tmp_path):
    data = os.urandom(3 * ck._CHUNK + 12345)  # several blocks: the running state is carried between them
    (tmp_path / "f").write_bytes(data)
    assert ck.digest_of(tmp_path / "f") == xxhash.xxh3_64_hexdigest(data)


def test_the_storage_cause_is_the_operating_systems(tmp_path):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    try:  # wrapped as Megatron's writer and torch's checkpoint code wrap it
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos") from inner
    except RuntimeError as wrapped:
        outer = RuntimeError("CheckpointException ranks:dict_keys([0])", {0: (wrapped, None)})
    assert ck.storage_cause(outer, tmp_path) == "No space left on device (errno ENOSPC)"
    # gathered from the ranks, the writer's error arrives pickled: its cause is lost, its text names it
    gathered = RuntimeError("CheckpointException ranks:dict_keys([1])",
                            {1: (RuntimeError(f"Worker failure: {OSError(errno.EACCES, 'Permission denied', '/c/x')}"),)})
    assert ck.storage_cause(gathered, tmp_path) == "Permission denied (errno EACCES)"
    # no OSError behind it (torch's writer reports a full disk as a position check): a probe write asks
    assert ck.storage_cause(RuntimeError("unexpected pos 704 vs 598"), tmp_path) == "unexpected pos 704 vs 598"
    assert list(tmp_path.iterdir()) == []  # (the probe is removed)
    assert ck.storage_cause(RuntimeError("x"), tmp_path / "gone").startswith("No such file or directory (errno ENOENT)")


def test_free_space_is_checked_against_the_previous_checkpoint(tmp_path):
    previous = _checkpoint(tmp_path, 1, FILES)
    target = tmp_path / "iter_0000002"
    assert saving._space_problem(tmp_path, target) is None
    free = shutil.disk_usage(tmp_path).free
    marker = json.loads((previous / ck.MARKER).read_text())
    marker["files"]["__0_0.distcp"][0] = free  # the previous checkpoint "took" all the free space
    (previous / ck.MARKER).write_text(json.dumps(marker))
    problem = saving._space_problem(tmp_path, target)
    assert problem.startswith(f"{tmp_path}: ") and "free, the previous checkpoint (iter_0000001) took " in problem
    assert problem.endswith("; nothing was written")
    assert saving._space_problem(tmp_path / "empty", target) is None  # the first save: nothing to compare with


def test_pruning_keeps_the_saved_checkpoint_and_the_newest_older_ones(tmp_path):
    for i in (1, 2, 3, 5, 6):  # 5, 6: a run resumed from 3 abandoned them (e.g. 6 did not verify)
        _checkpoint(tmp_path, i, FILES)
    (tmp_path / "iter_0000004").mkdir()  # partial: not counted, replaced when 4 is saved
    (tmp_path / "iter_0000002.bak").mkdir()  # not a checkpoint name: never touched
    saving._prune(tmp_path, tmp_path / "iter_0000003", keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000002.bak", "iter_0000003",
                                                          "iter_0000004"]
    os.truncate(tmp_path / "iter_0000003" / "common.pt", 1)  # the saved one is not whole: nothing is removed
    saving._prune(tmp_path, tmp_path / "iter_0000003", keep_last=1)
    assert (tmp_path / "iter_0000002").is_dir()


def test_find_checkpoint_skips_one_whose_sizes_differ(tmp_path):
    _checkpoint(tmp_path, 1, FILES)
    newest = _checkpoint(tmp_path, 2, FILES)
    assert ck.find_checkpoint("auto", tmp_path) == newest
    os.truncate(newest / "common.pt", 2)
    assert ck.find_checkpoint("auto", tmp_path) == tmp_path / "iter_0000001"
    assert ck.find_checkpoint(str(newest), tmp_path) == newest  # named: resuming verifies it, and stops
    assert ck.resume_candidates("auto", tmp_path) == ([newest, tmp_path / "iter_0000001"], False)
    assert ck.resume_candidates(str(tmp_path), "unused") == ([newest, tmp_path / "iter_0000001"], False)
    assert ck.resume_candidates(str(newest), "unused") == ([newest], True)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint there"):
        ck.resume_candidates(str(tmp_path / "none"), "unused")


def test_config_digest_and_changes():
    saved = {"trainer": {"iterations": 3, "lr": 1e-3}, "checkpoint": {"resume": None, "keep_last": 2}}
    resumed = {"trainer": {"iterations": 5, "lr": 1e-3}, "checkpoint": {"resume": "auto", "keep_last": 2}}
    assert ck.config_changes(saved, resumed) == ["trainer.iterations: 3 -> 5"]
    assert ck.config_digest(saved) != ck.config_digest(resumed)
    resumed["trainer"]["iterations"] = 3
    assert ck.config_digest(saved) == ck.config_digest(resumed)  # checkpoint.resume is not part of it


def test_a_folder_with_an_earlier_run_is_named_and_cleared(tmp_path):
    from sparse_rl_mega.config import load_config
    from sparse_rl_mega.runtime.jobs import clear_earlier_run, earlier_run, earlier_run_problem
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "examples" / "cpu_tiny.yaml", [f"trainer.run_dir={tmp_path}"])
    assert earlier_run(cfg) is None
    (tmp_path / "mlflow.db").write_text("")  # a store alone is no earlier run: MLflow keeps many runs
    assert earlier_run(cfg) is None
    folder = tmp_path / "checkpoints"
    saved = _checkpoint(folder, 1, FILES)
    marker = json.loads((saved / ck.MARKER).read_text())
    (saved / ck.MARKER).write_text(json.dumps({**marker, "mlflow_run_id": "abc123"}))
    (folder / "iter_0000002").mkdir()
    (tmp_path / "timeline.jsonl").write_text("{}\n")
    what = earlier_run(cfg)
    assert what == f"checkpoints iter_0000001..iter_0000002 in {folder}, of MLflow run abc123; timeline.jsonl"
    assert earlier_run_problem(cfg, what).endswith("continue it with --resume, choose a new trainer.run_dir, or "
                                                   "add --overwrite to remove its checkpoints and records first")
    assert clear_earlier_run(cfg) == what
    assert earlier_run(cfg) is None and (tmp_path / "mlflow.db").is_file()
