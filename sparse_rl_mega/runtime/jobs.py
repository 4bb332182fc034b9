"""What a job does about its own processes and folders: ranks that end with their launcher, a lock on
the run (and checkpoint) folder, and one line per failure with the traceback in the run folder."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Optional

from sparse_rl_mega.runtime import warm_fork
from sparse_rl_mega.runtime.checkpoint_files import MARKER, checkpoint_folder, complete_checkpoints

LOCK_HELD_ENV = "SPARSE_RL_MEGA_LOCKED"  # set by a launcher that holds the job's folder locks
# set by a tool that starts launches (sparse_rl_mega/cli/launches.py): the launcher stops as on SIGTERM when
# that tool (or the server it forked the launch from) ends, however it ends
STOP_WITH_PARENT_ENV = "SPARSE_RL_MEGA_STOP_WITH_PARENT"
warm_fork.read_after_start(LOCK_HELD_ENV, STOP_WITH_PARENT_ENV)  # (read by a launcher as it starts)


TORCHRUN_COMMANDS = ("torchrun", "torch.distributed.run", "torch/distributed/run.py")


def end_torchrun_agent(local_rank: int, wait_s: float = 30.0) -> None:
    """Under torchrun, after a usage error found before the job started (printed already): end its agent
    so that it does not add a 30-line report of the failed worker to that line. The node's first process
    kills the agent (SIGKILL: nothing of the job exists yet; the node's workers die with it, see
    :func:`runtime.warm_fork.die_with_parent`; torchrun exits with status 137); the others wait for that, so the agent never
    sees a worker fail first. Returns at once when the parent is not torchrun's agent."""
    parent = os.getppid()
    try:
        command = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if not any(name in command for name in TORCHRUN_COMMANDS):
        return
    sys.stderr.flush()
    if local_rank == 0:
        os.kill(parent, signal.SIGKILL)
    time.sleep(wait_s)  # (bounded: a parent that survives leaves this process to exit on its own)


class JobWideError(RuntimeError):
    """A failure that every rank raises with the same message (e.g. a checkpoint that could not be
    written): rank 0 alone prints it."""


def lock_file(path: Path, wait: bool) -> tuple[IO, bool]:
    """Open ``path`` (made if missing; appending, and reading) and take its POSIX record lock, waiting for
    it with ``wait``: the handle, and whether it is locked (False: another process holds it; the handle
    stays open to read the file). A holder that ends removes its file: one removed between our open and
    our lock is not the file at ``path`` any more, and the new one is opened."""
    while True:
        handle = open(path, "a+")
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return handle, False
        if is_the_file(path, handle):
            return handle, True
        handle.close()


def is_the_file(path: Path, handle: IO) -> bool:
    """Whether ``handle`` is still the file at ``path`` (not one its holder removed meanwhile)."""
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


class FolderLocked(RuntimeError):
    """Another job writes the folder."""


class FolderLock:
    """An exclusive lock on ``<folder>/.lock`` for the lifetime of this process (POSIX record lock, so
    it also holds between hosts on NFS): the kernel releases it when the process ends, however it
    ends. The file names the holder (host, pid, start time) for the message a second job gets. A job
    that ends removes it (:meth:`release`); one that was killed leaves it unlocked, and the next job
    takes it."""

    def __init__(self, folder: Path, what: str):
        self.path = Path(folder) / ".lock"
        self.what = what
        self.handle = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, locked = lock_file(self.path, wait=False)
        if locked:
            return self._hold(handle)
        handle.seek(0)  # held by another job: it names itself in the file
        holder = handle.read().strip()
        handle.close()
        try:
            h = json.loads(holder)
            who = f"host {h['host']}, pid {h['pid']}, since {h['since']}"
        except (ValueError, KeyError):
            who = "another process"
        raise FolderLocked(
            f"{self.what} {self.path.parent} is in use by another job ({who}); stop that job first. If it no "
            f"longer exists (a lock left behind on a shared file system), delete {self.path}")

    def _hold(self, handle) -> None:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        handle.flush()
        self.handle = handle  # held (and the lock with it) until this process ends

    def release(self) -> None:
        """Remove the file (still locked, so no job takes it meanwhile) and unlock."""
        if self.handle is not None:
            if is_the_file(self.path, self.handle):
                self.path.unlink()
            self.handle.close()
            self.handle = None


def lock_job_folders(cfg) -> list[FolderLock]:
    """Lock the run folder and, when it lies elsewhere, the checkpoint folder; raises
    :class:`FolderLocked` naming the holder."""
    run_dir = Path(cfg.trainer.run_dir).resolve()
    locks = [FolderLock(run_dir, "run folder (trainer.run_dir)")]
    if cfg.checkpoint.dir:
        ckpt = Path(cfg.checkpoint.dir).resolve()
        if run_dir not in ckpt.parents and ckpt != run_dir:
            locks.append(FolderLock(ckpt, "checkpoint folder (checkpoint.dir)"))
    taken = []
    try:
        for lock in locks:
            lock.acquire()
            taken.append(lock)
    except FolderLocked:
        for lock in taken:
            lock.release()
        raise
    return taken


RUN_RECORDS = ("timeline.jsonl", "eval.json")  # what a run writes into its run folder as it trains


def earlier_run(cfg) -> Optional[str]:
    """What an earlier run left in this job's folders (its checkpoints, complete or partial; its
    per-iteration records), in a few words; None when they hold none. A run that is not resuming must
    not mix its checkpoints with another's: ``--resume`` would continue the newest of either."""
    run_dir, folder = Path(cfg.trainer.run_dir), checkpoint_folder(cfg)
    saved = sorted(folder.glob("iter_*")) if folder.is_dir() else []
    records = [name for name in RUN_RECORDS if (run_dir / name).is_file()]
    if not saved and not records:
        return None
    parts = []
    if saved:
        complete = complete_checkpoints(folder)
        run_id = None
        if complete:
            try:
                run_id = json.loads((complete[-1] / MARKER).read_text()).get("mlflow_run_id")
            except (OSError, ValueError):
                pass
        span = saved[0].name if len(saved) == 1 else f"{saved[0].name}..{saved[-1].name}"
        parts.append(f"checkpoints {span} in {folder}" + (f", of MLflow run {run_id}" if run_id else ""))
    if records:
        parts.append(" and ".join(records))
    return "; ".join(parts)


def clear_earlier_run(cfg) -> str:
    """Remove an earlier run's checkpoints and per-iteration records (``--overwrite``; the MLflow store
    keeps its runs); returns what was removed."""
    import shutil

    what = earlier_run(cfg)
    folder = checkpoint_folder(cfg)
    for checkpoint in (sorted(folder.glob("iter_*")) if folder.is_dir() else []):
        shutil.rmtree(checkpoint)
    for name in RUN_RECORDS:
        (Path(cfg.trainer.run_dir) / name).unlink(missing_ok=True)
    return what or "nothing"


def earlier_run_problem(cfg, what: str) -> str:
    return (f"trainer.run_dir {Path(cfg.trainer.run_dir)} holds an earlier run ({what}): continue it with "
            f"--resume, choose a new trainer.run_dir, or add --overwrite to remove its checkpoints and records "
            f"first")


def report_failure(exc: BaseException, run_dir: str, rank: int) -> str:
    """Write ``exc``'s traceback to ``<run_dir>/logs/rank<R>.log`` and return the one line to print."""
    path = Path(run_dir) / "logs" / f"rank{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} failed\n")
            f.write("".join(traceback.format_exception(exc)))
        where = f" (traceback in {path})"
    except OSError:
        where = ""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"[error] rank {rank}: {message}{where}"


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` only says that another rank went away (its own failure is reported there)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "DistNetworkError", "connection was closed"))


def print_error(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def held_by_launcher() -> Optional[str]:
    return os.environ.get(LOCK_HELD_ENV)
