"""Fault injection for ``tools/chaos.py`` and the reliability tests: a real signal sent to a real
process of the job at a chosen point of the loop.

``SPARSE_RL_MEGA_FAULT="<fault>@<phase>:<iteration>[+<delay_s>][,<another>...]"``, e.g.
``kill-engine@rollout:3+0.4``: when iteration 3 (counted from 1) enters ``phase`` (rollout, train,
sync, checkpoint; ``push``: the weight push itself, after the sync's logprob check), the fault fires
``delay_s`` seconds later (default 0), from a helper thread, once per run folder (a marker file
``<run_dir>/.fault_<spec>`` keeps a restarted job from firing it again). Faults:

* ``kill-engine`` / ``stop-engine``: SIGKILL / SIGSTOP engine 0's scheduler (its host does it);
* ``kill-rank<R>``: rank R sends itself SIGKILL;
* ``kill-launcher``: rank 0 sends SIGKILL to the launcher (``tools/launch.py``) that started the job.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

FAULT_ENV = "SPARSE_RL_MEGA_FAULT"
LAUNCHER_PID_ENV = "SPARSE_RL_MEGA_LAUNCHER_PID"
PHASES = ("rollout", "train", "sync", "push", "checkpoint")
_PATTERN = re.compile(r"^(kill-engine|stop-engine|kill-rank\d+|kill-launcher)@(\w+):(\d+)(?:\+([0-9.]+))?$")


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
        raise ValueError(f"{FAULT_ENV}={text!r}: expected <kill-engine|stop-engine|kill-rank<R>|kill-launcher>"
                         f"@<{'|'.join(PHASES)}>:<iteration>[+<delay_s>]")
    return Fault(match.group(1), match.group(2), int(match.group(3)), float(match.group(4) or 0.0))


class FaultInjector:
    """Reads the fault from the environment once; :meth:`at` is called by every rank at each phase."""

    def __init__(self, rank: int, run_dir: str, engine_pid: Callable[[], Optional[int]]):
        self.faults = parse_faults(os.environ.get(FAULT_ENV, ""))
        self.rank, self.run_dir, self.engine_pid = rank, Path(run_dir), engine_pid

    def at(self, phase: str, iteration: int) -> None:
        """``iteration``: 0-based, as in the loop."""
        for f in self.faults:
            marker = self.run_dir / f".fault_{f.spec()}"
            if f.phase != phase or f.iteration != iteration + 1 or marker.exists():
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
        if what.startswith("kill-rank"):
            return (os.getpid(), signal.SIGKILL) if int(what[len("kill-rank"):]) == self.rank else None
        launcher = os.environ.get(LAUNCHER_PID_ENV)
        return (int(launcher), signal.SIGKILL) if self.rank == 0 and launcher else None

    @staticmethod
    def _fire(pid: int, sig: int, delay_s: float) -> None:
        time.sleep(delay_s)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
