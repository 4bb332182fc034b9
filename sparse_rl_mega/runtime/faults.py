"""Fault injection for ``tools/chaos.py`` and the reliability tests: a real signal sent to a real
process of the job at a chosen point of the loop.

``SPARSE_RL_MEGA_FAULT="<fault>@<phase>:<iteration>[+<delay_s>][,<another>...]"``, e.g.
``kill-engine@rollout:3+0.4``: when iteration 3 (counted from 1) enters ``phase`` (rollout, train,
sync, checkpoint; ``push``: the weight push itself, after the sync's logprob check), the fault fires
``delay_s`` seconds later (default 0), from a helper thread, once per run folder (a marker file
``<run_dir>/.fault_<spec>`` keeps a restarted job from firing it again). Faults:

* ``kill-engine`` / ``stop-engine``: SIGKILL / SIGSTOP engine 0's scheduler (its host does it);
* ``kill-rank<R>`` / ``stop-rank<R>``: rank R sends itself SIGKILL / SIGSTOP (a stopped rank: the
  learner's watchdog must find it, ``sparse_rl_mega/runtime/watchdog.py``);
* ``kill-launcher``: rank 0 sends SIGKILL to the launcher (``tools/launch.py``) that started the job;
* ``full-disk``: rank 0's next checkpoint write fails inside Megatron's writer with the operating
  system's ``OSError(ENOSPC)`` (as on a full disk; use it at the ``checkpoint`` phase; no delay);
* ``kill-tracking``: rank 0 sends SIGKILL to the process group of the MLflow tracking server whose pid
  ``SPARSE_RL_MEGA_TRACKING_SERVER_PID`` names (``tools/chaos.py`` starts one, and starts it again);
* ``corrupt-checkpoint``: rank 0 cuts the largest shard file of the newest complete checkpoint to half
  its size, then sends itself SIGKILL (the launcher's ``--max-restarts`` then resumes, which must skip it).
"""
from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from collections.abc import Callable

from sparse_rl_mega.runtime import warm_fork
from sparse_rl_mega.runtime.checkpoint_files import complete_checkpoints

FAULT_ENV = "SPARSE_RL_MEGA_FAULT"
LAUNCHER_PID_ENV = "SPARSE_RL_MEGA_LAUNCHER_PID"
warm_fork.read_after_start(FAULT_ENV, LAUNCHER_PID_ENV)  # (read as faults are armed, not at import)
TRACKING_SERVER_PID_ENV = "SPARSE_RL_MEGA_TRACKING_SERVER_PID"
PHASES = ("rollout", "train", "sync", "push", "checkpoint")
_PATTERN = re.compile(r"^(kill-engine|stop-engine|kill-rank\d+|stop-rank\d+|kill-launcher|full-disk|corrupt-checkpoint|"
                      r"kill-tracking)"
                      r"@(\w+):(\d+)(?:\+([0-9.]+))?$")


@dataclass(frozen=True)
class Fault:
    what: str
    phase: str
    iteration: int  # 1-based
    delay_s: float = 0.0

    def spec(self) -> str:
        return f"{self.what}@{self.phase}:{self.iteration}+{self.delay_s:g}"


def parse_faults(text: str) -> list[Fault]:
    return [parse_fault(part) for part in text.split(",") if part.strip()]


def parse_fault(text: str) -> Fault:
    match = _PATTERN.match(text.strip())
    if not match or match.group(2) not in PHASES:
        raise ValueError(f"{FAULT_ENV}={text!r}: expected <kill-engine|stop-engine|kill-rank<R>|stop-rank<R>|kill-launcher|"
                         f"full-disk|corrupt-checkpoint|kill-tracking>"
                         f"@<{'|'.join(PHASES)}>:<iteration>[+<delay_s>]")
    return Fault(match.group(1), match.group(2), int(match.group(3)), float(match.group(4) or 0.0))


class FaultInjector:
    """Reads the fault from the environment once; :meth:`at` is called by every rank at each phase."""

    def __init__(self, rank: int, run_dir: str, engine_pid: Callable[[], Optional[int]],
                 checkpoint_dir: Optional[str] = None):
        self.faults = parse_faults(os.environ.get(FAULT_ENV, ""))
        self.rank, self.run_dir, self.engine_pid = rank, Path(run_dir), engine_pid
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else self.run_dir / "checkpoints"

    def at(self, phase: str, iteration: int) -> None:
        """``iteration``: 0-based, as in the loop."""
        for f in self.faults:
            marker = self.run_dir / f".fault_{f.spec()}"
            if f.phase != phase or f.iteration != iteration + 1 or marker.exists():
                continue
            if f.what in ("full-disk", "corrupt-checkpoint"):
                if self.rank == 0:
                    marker.write_text("fired\n")
                    fail_next_checkpoint_write() if f.what == "full-disk" else self._corrupt_newest_checkpoint()
                continue
            target = self._target(f.what)
            if target is None:
                continue
            pid, sig = target
            marker.write_text("fired\n")
            threading.Thread(target=self._fire, args=(pid, sig, f.delay_s), daemon=True, name="fault").start()

    def _target(self, what: str) -> Optional[tuple[int, int]]:
        if what in ("kill-engine", "stop-engine"):
            pid = self.engine_pid()  # only engine 0's host has one
            return None if pid is None else (pid, signal.SIGKILL if what == "kill-engine" else signal.SIGSTOP)
        if what.startswith(("kill-rank", "stop-rank")):
            sig = signal.SIGKILL if what.startswith("kill") else signal.SIGSTOP
            return (os.getpid(), sig) if int(what.rsplit("rank", 1)[1]) == self.rank else None
        if what == "kill-tracking":
            server = os.environ.get(TRACKING_SERVER_PID_ENV)
            return (-int(server), signal.SIGKILL) if self.rank == 0 and server else None  # (its process group)
        launcher = os.environ.get(LAUNCHER_PID_ENV)
        return (int(launcher), signal.SIGKILL) if self.rank == 0 and launcher else None

    def _corrupt_newest_checkpoint(self) -> None:
        newest = complete_checkpoints(self.checkpoint_dir)
        if newest:
            shard = max(newest[-1].glob("*.distcp"), key=lambda f: f.stat().st_size)
            os.truncate(shard, shard.stat().st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _fire(pid: int, sig: int, delay_s: float) -> None:
        time.sleep(delay_s)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def fail_next_checkpoint_write() -> None:
    """The next item that Megatron's checkpoint writer writes fails as on a full disk: the operating
    system's ENOSPC, raised where the write happens (``filesystem_async._write_item``); once."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._write_item

    def full_disk(*args, **kwargs):
        filesystem_async._write_item = original
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    filesystem_async._write_item = full_disk
