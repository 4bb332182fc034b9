"""The learner's watchdog: a job whose ranks have all stopped making progress is stopped, with one line
naming the rank to blame, so that ``--max-restarts`` (or torchrun's) continues it from its newest
checkpoint instead of it waiting for the process group's timeout (30 min or more) in silence.

Every rank publishes, once a second from a thread of its own, a record in the job's c10d store: its
phase and iteration, a progress counter (phase changes, and beats from long waits that are making
progress: every poll of an engine that answers, the wait for an engine's start), a heartbeat counter
(the thread's own: it stops when the process does not run: SIGSTOP, a frozen host) and its current
bound. Two ranks (the first and the last) read every record each second and note, on their own
clock, when each counter last changed. When no rank has made progress for longer than the largest
bound that a running rank published (a rank whose heartbeat stopped holds no one up), the job is stuck: the rank to blame is one whose heartbeat stopped (the
oldest), else the one whose progress is oldest (the others wait for it in a collective). The first
monitor to claim the verdict in the store prints it, kills the rank to blame when it runs on its own
host (a stopped process would hold torchrun's agent for its 30 s stop timeout), and exits with
:data:`EXIT_STATUS`; the agent stops the rest and the launcher says that the watchdog stopped the job.

A rank's bound in a phase it has completed before is ``max(floor, factor x the longest time that phase
took)`` (``trainer.watchdog_floor_s``, ``trainer.watchdog_factor``); in a phase it has not completed
yet (set-up, the first checkpoint, the first evaluation, a first compile) it is
``trainer.watchdog_first_s``. Between the named phases of the loop a rank is in phase ``iteration``,
bounded by the longest iteration so far. Shutting down has a bound of its own, from the timeouts of
what it waits for (the tracking store, the engines). The learner's collectives keep the process group's timeout as their
outer bound: gloo and NCCL take one timeout when the group is made, and it must cover a rank that waits
for another one's engine restart (``rollout.startup_timeout_s``).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from collections.abc import Callable

from sparse_rl_mega.runtime.jobs import print_error

EXIT_STATUS = 86  # a rank's exit status when its watchdog stopped the job (tools/launch.py names it)
HEARTBEAT_S = 1.0  # how often a rank publishes its record, and a monitor reads them all
NOT_RUNNING_S = 5.0  # a heartbeat unchanged this long: the process does not run (for the blame only)


@dataclass(frozen=True)
class Bounds:
    floor_s: float  # no bound below this (0: no watchdog)
    factor: float  # times the longest duration of the same phase so far
    first_s: float  # a phase not completed before


@dataclass
class _Seen:
    """What a monitor knows of one rank: its last record and when (monitor's clock) its counters changed."""
    record: dict
    beats_changed_at: float
    progress_changed_at: float


class Watchdog:
    """One rank's watchdog. ``store``: the job's c10d store (a clone: this thread's own connection);
    ``clock``: monotonic seconds; ``stop(status)`` ends the process (tests pass their own). The thread
    calls :meth:`tick` every :data:`HEARTBEAT_S`."""

    def __init__(self, store, rank: int, world_size: int, bounds: Bounds, run_dir: str,
                 clock: Callable[[], float] = time.monotonic, report: Optional[Callable[[str], None]] = None,
                 stop: Callable[[int], None] = os._exit):
        self.store, self.rank, self.world_size, self.bounds = store, rank, world_size, bounds
        self.run_dir, self.clock, self.stop_process = Path(run_dir), clock, stop
        self.report = report or _print_error
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.monitor = rank in (0, world_size - 1) and world_size > 1  # (one rank alone: no one to watch it)
        self.phase, self.iteration, self.progress, self.beats = "setup", 0, 0, 0
        self.phase_started = clock()
        self.outer: list[tuple[str, float]] = []  # the phases this one runs inside, with their starts
        self.longest: dict[str, float] = {}  # phase -> the longest it took on this rank
        self.fixed: dict[str, float] = {}  # phase -> a bound of its own (a phase bounded by known waits)
        self.seen: dict[int, _Seen] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- called by the training loop
    def at_iteration(self, iteration: int) -> None:
        """The loop starts ``iteration`` (0-based): between named phases a rank is in phase
        ``iteration``, bounded by the longest iteration so far (the one before is measured here)."""
        with self.lock:
            now = self.clock()
            if self.phase == "iteration" and not self.outer:
                self.longest["iteration"] = max(self.longest.get("iteration", 0.0), now - self.phase_started)
            self.phase, self.phase_started, self.outer = "iteration", now, []
            self.iteration = iteration
            self.progress += 1
        self._publish()  # (now: a rank stopped in the next second must not be named with the iteration before)

    def enter(self, phase: str, bound_s: Optional[float] = None) -> None:
        """``phase`` starts (inside the current one); ``bound_s``: its own bound instead of one derived
        from its past durations."""
        with self.lock:
            if bound_s is not None:
                self.fixed[phase] = bound_s
            self.outer.append((self.phase, self.phase_started))
            self.phase, self.phase_started = phase, self.clock()
            self.progress += 1

    def leave(self, phase: str, completed: bool = True) -> None:
        """``phase`` (the one entered last) ended: its duration counts towards its bound when it
        ``completed``, and the rank is back in the phase around it."""
        with self.lock:
            if completed:
                took = self.clock() - self.phase_started
                self.longest[phase] = max(self.longest.get(phase, 0.0), took)
            if self.outer:
                self.phase, self.phase_started = self.outer.pop()
            self.progress += 1

    def beat(self) -> None:
        """Progress within a phase (a long wait that is getting somewhere)."""
        with self.lock:
            self.progress += 1

    def bound(self) -> tuple[float, str]:
        """This rank's bound in its current phase, and where it comes from."""
        b = self.bounds
        if self.phase in self.fixed:
            return self.fixed[self.phase], f"the bound of {self.phase}, from the timeouts of its waits"
        if self.phase not in self.longest:
            return b.first_s, f"{self.phase} not completed before here: trainer.watchdog_first_s"
        derived = b.factor * self.longest[self.phase]
        if derived <= b.floor_s:
            return b.floor_s, f"trainer.watchdog_floor_s; {b.factor:g} x the longest {self.phase} is less"
        return derived, f"{b.factor:g} x the longest {self.phase} so far, {self.longest[self.phase]:.1f} s"

    # ---------------------------------------------------------------- the thread
    def start(self) -> None:
        self.tick()  # (the record exists before the loop's first phase)
        self.thread = threading.Thread(target=self._run, daemon=True, name="watchdog")
        self.thread.start()

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=2 * HEARTBEAT_S + 10)

    def _run(self) -> None:
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 (the store went away, or a bug: said once, never silent)
                if not self.stopping.is_set():
                    self.report(f"[watchdog] rank {self.rank}: no longer watching ({type(exc).__name__}: {exc})")
                return

    def tick(self) -> Optional[str]:
        """Publish this rank's record; on a monitor rank, read every record and stop the job when it is
        stuck. Returns the verdict line when this rank stopped the job (tests), else None."""
        with self.lock:
            self.beats += 1
        self._publish(strict=True)
        if not self.monitor or self.stopping.is_set():
            return None
        verdict = self.check()
        if verdict is None:
            return None
        line, culprit = verdict
        if self.store.compare_set("verdict", "", line).decode() != line:
            return None  # the other monitor claimed it first: it reports and stops the job
        self._stop_job(line, culprit)
        return line

    def _publish(self, strict: bool = False) -> None:
        """This rank's record to the store. ``strict`` (the thread): a store error raises, and the thread
        says that it stopped watching; from the loop it is ignored (the job is ending)."""
        with self.lock:
            bound, why = self.bound()
            record = {"phase": self.phase, "iteration": self.iteration, "progress": self.progress,
                      "beats": self.beats, "bound": bound, "why": why, "host": self.host, "pid": self.pid}
        try:
            self.store.set(f"rank{self.rank}", json.dumps(record))
        except Exception:  # (the store went away: the job is ending)
            if strict:
                raise

    def check(self) -> Optional[tuple[str, dict]]:
        """(the verdict line, the record of the rank to blame) when no rank has made progress within the
        largest bound that a running rank published; None while the job progresses."""
        keys = [f"rank{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            return None  # a rank has not published yet (set-up's own timeouts cover that)
        now = self.clock()
        for r, raw in enumerate(self.store.multi_get(keys)):
            record = json.loads(raw)
            seen = self.seen.get(r)
            if seen is None:
                self.seen[r] = _Seen(record, now, now)
                continue
            if record["beats"] != seen.record["beats"]:
                seen.beats_changed_at = now
            if record["progress"] != seen.record["progress"]:
                seen.progress_changed_at = now
            seen.record = record
        if len(self.seen) < self.world_size:
            return None
        quiet = now - max(s.progress_changed_at for s in self.seen.values())
        # a rank that does not run holds no one up with its bound (its last record may be older than the
        # phase it stopped in: a first-time bound of 35 min kept a stopped rank's job waiting)
        running = {r: s for r, s in self.seen.items() if now - s.beats_changed_at <= NOT_RUNNING_S}
        widest = max((running or self.seen).items(), key=lambda item: item[1].record["bound"])
        bound, why = widest[1].record["bound"], widest[1].record["why"]
        if quiet <= bound:
            return None
        not_running = [(r, s) for r, s in self.seen.items() if r not in running]
        if not_running:
            r, s = min(not_running, key=lambda item: item[1].beats_changed_at)
            how = f"has not run for {now - s.beats_changed_at:.0f} s (its process is stopped or frozen)"
        else:
            r, s = min(self.seen.items(), key=lambda item: item[1].progress_changed_at)
            how = f"has made no progress for {now - s.progress_changed_at:.0f} s, the longest of all ranks"
        c = s.record
        line = (f"[watchdog] no rank has made progress for {quiet:.0f} s (bound {bound:.0f} s: {why}, rank {widest[0]}): "
                f"rank {r} (host {c['host']}, pid {c['pid']}) {how}, in phase {c['phase']} of iteration "
                f"{c['iteration'] + 1}; stopping the job")
        return line, c

    def _stop_job(self, line: str, culprit: dict) -> None:
        self.report(line)
        try:
            logs = self.run_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / "watchdog.log", "a") as out:
                out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:
            pass
        if culprit["host"] == self.host and culprit["pid"] != self.pid:
            try:
                os.kill(culprit["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop_process(EXIT_STATUS)


def fired_since(run_dir: str, since: float) -> bool:
    """Whether a watchdog of the job in ``run_dir`` stopped it after ``since`` (``time.time()``): the
    launcher's test (the rank it killed may be the failure torchrun's agent saw first)."""
    log = Path(run_dir) / "logs" / "watchdog.log"
    try:
        return log.stat().st_mtime >= since
    except OSError:
        return False


def _print_error(line: str) -> None:
    print_error(line)


# ------------------------------------------------------------------- the process's watchdog
_current: Optional[Watchdog] = None


def start(cfg, rank: int, world_size: int) -> Optional[Watchdog]:
    """Start this rank's watchdog on the default process group's store (None when
    ``trainer.watchdog_floor_s`` is 0 or the job has one rank)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    global _current
    t = cfg.trainer
    if not t.watchdog_floor_s or world_size < 2 or not dist.is_initialized():
        return None
    first_s = t.watchdog_first_s if t.watchdog_first_s is not None else cfg.rollout.startup_timeout_s + 300.0
    # keys of this start of the job only: torchrun's restarts keep the agent's store
    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{os.environ.get('SPARSE_RL_MEGA_LAUNCHED_AT', '')}"
    store = dist.PrefixStore(f"sparse_rl_mega_watchdog/{attempt}", _get_default_store().clone())
    _current = Watchdog(store, rank, world_size, Bounds(t.watchdog_floor_s, t.watchdog_factor, first_s),
                        cfg.trainer.run_dir)
    _current.start()
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


def at_iteration(iteration: int) -> None:
    if _current is not None:
        _current.at_iteration(iteration)


def enter(phase: str, bound_s: Optional[float] = None) -> None:
    if _current is not None:
        _current.enter(phase, bound_s)


def leave(phase: str, completed: bool = True) -> None:
    if _current is not None:
        _current.leave(phase, completed)


def beat() -> None:
    if _current is not None:
        _current.beat()
