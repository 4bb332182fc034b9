"""A job's processes and folders: nothing outlives a killed launcher, a second job on a run folder in
use is refused with the holder named, and a user's mistake in the data is one line per problem before
any worker starts; rendezvous ports are not taken by other connections before torchrun binds them.
(Engine crashes and hangs during a run: tests/test_resume.py; non-finite steps:
tests/test_layout_invariance.py; the KV soak: tests/test_engine_retraction.py.)"""
import json
import os
import time

import psutil
import pytest

from sparse_rl_mega.train.tracking import default_tracking_uri
from tests.conftest import ROOT, TRAIN_DATA, alive, run_launch, start_script, write_test_config


def run_status(run_dir, run_id: str) -> str:
    import mlflow

    return mlflow.MlflowClient(tracking_uri=default_tracking_uri(run_dir)).get_run(run_id).info.status


def test_bad_data_rows_are_reported_before_anything_starts(tiny_model_dir, tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "1 + 2 =", "label": "3"}\n{"prompt": "2 + 2 ="}\nnot json\n')
    config = write_test_config(tmp_path / "bad.yaml", tiny_model_dir, tmp_path / "run")
    config.write_text(config.read_text().replace(str(TRAIN_DATA), str(rows)))
    started = time.perf_counter()
    done = run_launch(config, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert time.perf_counter() - started < 60  # no worker, engine or learner was started
    assert "[setup]" not in done.stdout and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    # one message: what is wrong with the file, then each bad row as file:row
    assert lines[0].startswith(f"config error: {config}: data.train_path: {rows}"), lines
    assert [line.split(": ")[0].strip() for line in lines[1:]] == [f"{rows}:2", f"{rows}:3"], lines


def test_a_folder_with_an_earlier_run_is_refused_before_anything_starts(tiny_model_dir, tmp_path):
    """Another run's checkpoint in the run folder, no --resume: one line offering --resume, a new folder
    or --overwrite; nothing started, nothing removed."""
    run_dir = tmp_path / "run"
    earlier = run_dir / "checkpoints" / "iter_0000002"
    earlier.mkdir(parents=True)
    config = write_test_config(tmp_path / "job.yaml", tiny_model_dir, run_dir)
    started = time.perf_counter()
    done = run_launch(config, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert time.perf_counter() - started < 60 and "[setup]" not in done.stdout
    assert done.stderr.strip() == (
        f"config error: {config}: trainer.run_dir {run_dir} holds an earlier run (checkpoints iter_0000002 in "
        f"{run_dir / 'checkpoints'}): continue it with --resume, choose a new trainer.run_dir, or add --overwrite "
        "to remove its checkpoints and records first"), done.stderr
    assert earlier.is_dir() and not (run_dir / ".lock").exists()


def test_killed_launcher_leaves_no_process_and_its_lock_names_the_holder(tiny_model_dir, tmp_path):
    """SIGKILL of ``tools/launch.py`` while its job runs (injected as the second rollout starts, after a
    checkpoint was saved): every process of the job (learner ranks, SGLang scheduler and detokenizer,
    the engine's process server) is gone within seconds. While it ran, a second job on the
    same run folder stopped at once, naming the first one's host and pid. What the job could not end
    itself, the next launch into its folder ends, naming it: its engine's /dev/shm file, recorded by
    its rank, and its MLflow run, left RUNNING (then KILLED)."""
    run_dir = tmp_path / "run"
    config = write_test_config(tmp_path / "job.yaml", tiny_model_dir, run_dir)
    log = tmp_path / "job.log"
    # 50 iterations: orphans, if any, would still be training when they are looked for
    job = start_script(ROOT / "tools" / "launch.py", [config, "--set=trainer.iterations=50"],
                       {"SPARSE_RL_MEGA_FAULT": "kill-launcher@rollout:2"}, log)
    seen: set[int] = set()
    try:
        lock = run_dir / ".lock"
        deadline = time.time() + 60
        while not (lock.is_file() and lock.read_text().strip()) and time.time() < deadline:
            time.sleep(0.2)
        second = run_launch(config, timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert "is in use by another job (host " in second.stderr and f"pid {job.pid}," in second.stderr, second.stderr
        assert "[setup]" not in second.stdout
        deadline = time.time() + 300
        while job.exitcode is None and time.time() < deadline:
            try:
                seen.update(p.pid for p in psutil.Process(job.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        job.join(timeout=5)
        assert job.exitcode == -9, log.read_text()[-3000:]
        assert len(seen) >= 5, seen  # two learner ranks, the engine's process server, scheduler, detokenizer
        deadline = time.time() + 10
        while alive(seen) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(seen), [(p, psutil.Process(p).cmdline()[:3]) for p in alive(seen)]
        assert "[iter 2/50]" not in log.read_text()  # nothing trained on without it
        # what it could not end: its engine's /dev/shm file (named in its rank's record) and its MLflow run
        (record,) = (run_dir / ".shm_files").glob("*.txt")
        left = [line.split(" ", 1)[1] for line in record.read_text().splitlines() if line.startswith("file ")]
        assert len(left) == 1 and os.path.exists(left[0]), record.read_text()
        killed_run = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
        assert run_status(run_dir, killed_run) == "RUNNING"
        # the next launch into the folder ends both, with a line each
        started = time.perf_counter()
        done = run_launch(config, "--overwrite", "--set=trainer.iterations=1", timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert (f"[setup] removed 1 file(s) an earlier job in {run_dir} left in /dev/shm (its engines were killed): "
                f"{os.path.basename(left[0])}") in done.stdout, done.stdout[-3000:]
        assert f"[tracking] MLflow run 'job-rkv12-sparse_rl' ({killed_run}) was left RUNNING by its job: ended as " \
               f"KILLED" in done.stdout, done.stdout[-3000:]
        assert not os.path.exists(left[0]) and not (run_dir / ".shm_files").exists()
        assert run_status(run_dir, killed_run) == "KILLED"
        print(f"next launch: {time.perf_counter() - started:.1f} s")
    finally:
        for pid in [job.pid, *seen]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


@pytest.mark.unit
def test_free_ports_come_from_below_the_ephemeral_range():
    """Rendezvous and weight-group ports are picked below the range the OS hands out as local ports of
    outgoing connections (one of those took a port checked free before torchrun bound it: EADDRINUSE
    in the suite), free when picked, and not the same at every call."""
    import socket

    from sparse_rl_mega.runtime.ports import LOWEST, ephemeral_range, free_port

    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(LOWEST <= port < low for port in ports), (low, ports)
    assert len(set(ports)) > 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


@pytest.mark.unit
def test_a_sweep_removes_only_what_dead_processes_recorded(tmp_path):
    """``rollout/shm_record.py``: a sweep of a run folder removes the /dev/shm files that records of this
    host's dead processes list (a pid-stamped file once its process is dead), and no other: not those a
    live process records (its record is locked), nor another host's, nor a file no record names."""
    import signal
    import socket
    import subprocess
    import sys
    import uuid

    from sparse_rl_mega.rollout.shm_record import RECORD_FOLDER, sweep

    tag, made = uuid.uuid4().hex[:8], []

    def shm(name: str) -> str:
        made.append(f"/dev/shm/{name}")
        open(made[-1], "w").close()
        return made[-1]

    ended = subprocess.Popen(["true"])
    ended.wait()
    dead_loads, live_loads, unrecorded, other_host = (shm(f"sglang_loads_test{tag}_{n}.shm") for n in "abcd")
    dead_queue, live_queue = shm(f"sgl_shm_mq_{ended.pid}_{tag}"), shm(f"sgl_shm_mq_{os.getpid()}_{tag}")
    folder = tmp_path / RECORD_FOLDER
    folder.mkdir()
    dead_record = folder / f"{socket.gethostname()}-{ended.pid}.txt"
    dead_record.write_text(f"file {dead_loads}\npids {ended.pid} {os.getpid()}\n")
    (folder / "another-host-1.txt").write_text(f"file {other_host}\n")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from sparse_rl_mega.rollout.shm_record import ShmRecord\n"
        f"record = ShmRecord({str(tmp_path)!r}); record.open(); record.add('file {live_loads}')\n"
        "print('held', flush=True); time.sleep(120)")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = sweep(tmp_path)
        assert sorted(removed) == sorted(os.path.basename(p) for p in (dead_loads, dead_queue)), removed
        assert all(os.path.exists(p) for p in (live_loads, unrecorded, other_host, live_queue))
        assert dead_record.exists()  # (a process it names still runs: this one)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        assert sweep(tmp_path) == [os.path.basename(live_loads)]
        assert sorted(p.name for p in folder.iterdir()) == sorted(["another-host-1.txt", dead_record.name])
    finally:
        holder.kill()
        holder.wait(timeout=10)
        for path in made:
            if os.path.exists(path):
                os.unlink(path)
