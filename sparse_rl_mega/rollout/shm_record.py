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
from typing import Callable, Iterable, Optional

import psutil

from sparse_rl_mega.rollout import sglang_internals

RECORD_FOLDER = ".shm_files"  # in the run folder


def _host() -> str:
    return socket.gethostname()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended: its files are no longer in use)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _remove_listed(lines: Iterable[str]) -> list[str]:
    """Remove the files ``lines`` name (those of live processes stay); the names removed."""
    removed = []
    for line in lines:
        kind, _, rest = line.strip().partition(" ")
        if kind == "file":
            paths = [rest]
        elif kind == "pids":
            dead = [int(pid) for pid in rest.split() if pid.isdigit() and not _alive(int(pid))]
            paths = sglang_internals.pid_stamped_shm_files(dead)
        else:
            continue
        for path in paths:
            try:
                os.unlink(path)
                removed.append(os.path.basename(path))
            except FileNotFoundError:
                pass
    return removed


def _record_is_done(lines: list[str]) -> bool:
    """Whether nothing a record lists can still exist (its pid-stamped files wait for live pids)."""
    for line in lines:
        kind, _, rest = line.strip().partition(" ")
        if kind == "file" and os.path.exists(rest):
            return False
        if kind == "pids" and any(pid.isdigit() and _alive(int(pid)) for pid in rest.split()):
            return False
    return True


def _wait_for_pids(lines: list[str], wait_s: float) -> None:
    """Wait at most ``wait_s`` for the processes ``lines`` name to end (an owner's engine processes end
    by their parent-death signal, just after it)."""
    pids = [int(pid) for line in lines if line.startswith("pids ") for pid in line.split()[1:] if pid.isdigit()]
    deadline = time.monotonic() + wait_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


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
            lines = handle.read().splitlines()
            _wait_for_pids(lines, wait_s)
            removed += _remove_listed(lines)
            if _record_is_done(lines):
                record.unlink(missing_ok=True)
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
        while True:
            handle = open(self.path, "a+")
            fcntl.lockf(handle, fcntl.LOCK_EX)  # (no other process takes a live one's lock for long)
            try:
                if os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino:
                    self.handle = handle
                    return
            except FileNotFoundError:
                pass
            handle.close()  # a sweep found it unlocked and removed it between our open and our lock

    def add(self, line: str) -> None:
        """Append ``line`` durably (it must be on disk before the file it names can exist)."""
        self.handle.write(line + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        """Remove what the record lists (the engines have ended) and, when nothing of it is left, the
        record; else the next job's sweep finishes it."""
        if self.handle is None:
            return
        self.handle.seek(0)  # (read through the locked handle: closing another one would drop the lock)
        lines = self.handle.read().splitlines()
        _remove_listed(lines)
        if _record_is_done(lines):
            self.path.unlink(missing_ok=True)
            _remove_if_empty(self.path.parent)
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
    for name in ([path] if path else []) + sglang_internals.pid_stamped_shm_files(pids):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
