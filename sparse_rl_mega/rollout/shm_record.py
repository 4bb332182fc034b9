"""The /dev/shm files of this job's engines, recorded in the run folder so that none outlives the job.

SGLang's processes end by SIGKILL, which skips its own unlinks: each engine leaves a load-snapshot
file (``sglang_loads_<instance>_<digest>.shm``, no process id in the name) and, at TP >= 2, message
queues named after the scheduler that made them (``sgl_shm_mq_<pid>_<random>``). An engine that is shut
down or killed by its owner removes its own (``RolloutEngine``); when the owner itself is killed (a
killed launcher, an OOM kill), nothing can. So each process that runs engines keeps a record,
``<run_dir>/.shm_files/<host>-<pid>.txt``, locked while it lives (a POSIX record lock: the kernel drops
it when the process ends, however it ends):

* ``file <path>``: a file an engine of this process will create, written before the engine starts;
* ``pids <pid> ...``: an engine's processes, whose pid-stamped files are removed once they are dead.

The next job in the run folder (which holds the folder's lock, so no other job writes there) removes what
the records of dead processes on its host name, says so in one line, and deletes those records. Only
names a record lists are ever removed: never another job's files."""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional
from collections.abc import Callable, Iterable

import psutil

from sparse_rl_mega.rollout import sglang_internals
from sparse_rl_mega.runtime.jobs import lock_file

RECORD_FOLDER = ".shm_files"  # in the run folder


def _host() -> str:
    return socket.gethostname()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended: its files are no longer in use)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listed(lines: Iterable[str]) -> tuple[list[str], list[int]]:
    """The files and the engine processes a record's ``lines`` name."""
    files, pids = [], []
    for line in lines:
        kind, _, rest = line.strip().partition(" ")
        if kind == "file":
            files.append(rest)
        elif kind == "pids":
            pids += [int(pid) for pid in rest.split() if pid.isdigit()]
    return files, pids


def _unlink(paths: Iterable[str]) -> list[str]:
    """Remove ``paths``; the names of those that were there."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except FileNotFoundError:
            pass
    return removed


def _clear(record: Path, lines: list[str], wait_s: float) -> list[str]:
    """Remove what a record whose owner has ended (or ends now: this process's own) lists, after waiting
    at most ``wait_s`` for the engine processes it names to end (by their parent-death signal, just after
    their owner); then the record itself, unless a pid-stamped file may still come from a process that
    lives. The names of the files removed."""
    files, pids = _listed(lines)
    deadline = time.monotonic() + wait_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = [pid for pid in pids if _alive(pid)]
    removed = _unlink(files + sglang_internals.pid_stamped_shm_files(set(pids) - set(running)))
    if not running:
        record.unlink(missing_ok=True)
        _remove_if_empty(record.parent)
    return removed


def sweep(run_dir: str | Path, wait_s: float = 0.0) -> list[str]:
    """Remove what the records of this host's dead processes in ``run_dir`` list, and those records; the
    names of the files removed. A record still locked belongs to a live process (this job's) and stays.
    ``wait_s``: how long to wait for the engine processes a dead owner's record names to end."""
    folder = Path(run_dir) / RECORD_FOLDER
    removed: list[str] = []
    for record in sorted(folder.glob(f"{_host()}-*.txt")) if folder.is_dir() else []:
        if record.name == f"{_host()}-{os.getpid()}.txt":
            continue  # (this process's own: POSIX locks do not exclude their owner)
        try:
            handle = open(record, "r+")
        except FileNotFoundError:
            continue
        with handle:
            try:
                fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its process lives
            removed += _clear(record, handle.read().splitlines(), wait_s)
    _remove_if_empty(folder)
    return removed


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # (not empty, or absent)
        pass


class ShmRecord:
    """This process's record (see the module's docstring), locked from :meth:`open` until it ends."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / RECORD_FOLDER / f"{_host()}-{os.getpid()}.txt"
        self.handle = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle, _ = lock_file(self.path, wait=True)  # (a sweep holds a dead record's lock only briefly)

    def add(self, line: str) -> None:
        """Append ``line`` durably (it must be on disk before the file it names can exist)."""
        self.handle.write(line + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        """Remove what the record lists (the engines have ended) and, when nothing of it can come back,
        the record; else the next job's sweep finishes it."""
        if self.handle is None:
            return
        self.handle.seek(0)  # (read through the locked handle: closing another one would drop the lock)
        _clear(self.path, self.handle.read().splitlines(), 0.0)
        self.handle.close()
        self.handle = None


_record: Optional[ShmRecord] = None  # this process's, while it runs a job's engines


def start_recording(run_dir: str | Path, log: Callable[[str], None] = print) -> None:
    """Sweep what earlier jobs on this host left in ``run_dir`` (one line naming it), then record the
    files of the engines this process starts."""
    global _record
    sweep_and_say(run_dir, "[setup]", "an earlier job", log)
    _record = ShmRecord(run_dir)
    _record.open()


def sweep_and_say(run_dir: str | Path, tag: str, whose: str, log: Callable[[str], None] = print,
                  wait_s: float = 0.0) -> None:
    """:func:`sweep`, and one line naming what it removed (nothing when it removed nothing)."""
    removed = sweep(run_dir, wait_s)
    if removed:
        shown = ", ".join(removed[:6]) + (f" and {len(removed) - 6} more" if len(removed) > 6 else "")
        log(f"{tag} removed {len(removed)} file(s) {whose} in {run_dir} left in /dev/shm (its engines were "
            f"killed): {shown}")


def stop_recording() -> None:
    global _record
    if _record is not None:
        _record.close()
        _record = None


def note(line: str) -> None:
    """Add ``line`` (``file <path>`` or ``pids <pid> ...``) to this process's record, if it keeps one."""
    if _record is not None:
        _record.add(line)


def remove_engine_files(sglang_engine, pids: Iterable[int]) -> None:
    """An engine's processes are gone: remove its load snapshot and the files stamped with their pids."""
    path = sglang_internals.load_snapshot_file(sglang_engine)
    _unlink(([path] if path else []) + sglang_internals.pid_stamped_shm_files(pids))
