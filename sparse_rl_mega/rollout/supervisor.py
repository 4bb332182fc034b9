"""Supervision of the rollout engines: start, failure and restart.

The engine's calls themselves carry the deadlines (``RolloutEngine._wait``: a call fails with
:class:`~sparse_rl_mega.rollout.engine.EngineFailure` when an engine process dies or the engine is
silent for ``rollout.engine_timeout_s``). Here:

* :class:`EngineSupervisor`: one host's engine. Starts it (in the background), restarts it after a
  failure, at most ``rollout.max_engine_restarts`` times in a job (``keep_process_on_child_crash`` in
  ``engine.py`` keeps the learner rank alive when an engine child crashes).
* :func:`agree_on_failures`: every rank learns which engines failed in a phase (a collective), so all
  ranks retry the phase together and the collectives of the learner stay matched.

Pushing the current weights to a restarted engine and sampling its lost shard again:
``rollout/fleet.py`` (``EngineFleet.recover``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Optional
from collections.abc import Callable

import torch.distributed as dist

from sparse_rl_mega.rollout.engine import EngineFailure, RolloutEngine
from sparse_rl_mega.runtime import watchdog


class EngineStart:
    """A :class:`RolloutEngine` started on a background thread, so that the learner is built and loaded
    meanwhile: SGLang's scheduler and detokenizer import and load in their own processes, this thread
    mostly waits for them. :meth:`result` waits, bounded, and re-raises the start's error here.

    The thread then stays parked until the engine shuts down: a GPU engine's children ask for SIGKILL
    when the *thread* that spawned them ends (``PR_SET_PDEATHSIG``; a CPU engine's are forked by the
    forkserver, which its own thread starts: ``rollout/forkserver.py``). SGLang sets no SIGQUIT
    handler off the main thread: call :func:`keep_process_on_child_crash` on the main thread, or a child that dies
    ends this process (SIGQUIT's default action)."""

    def __init__(self, *args, **kwargs):
        self.engine: Optional[RolloutEngine] = None
        self.error: Optional[BaseException] = None
        self.seconds: Optional[float] = None  # how long the start took, once done
        self._started = time.perf_counter()
        self._ready, self._stopped = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, name="engine-start", daemon=True)
        self._thread.start()

    def _run(self, *args, **kwargs) -> None:
        try:
            self.engine = RolloutEngine(*args, **kwargs)
            self.engine.on_shutdown = self._stopped.set
        except BaseException as exc:  # noqa: BLE001 (re-raised on the caller's thread)
            self.error = exc
            return
        finally:
            self.seconds = time.perf_counter() - self._started
            self._ready.set()
        self._stopped.wait()

    def result(self, timeout_s: float) -> RolloutEngine:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(min(1.0, max(deadline - time.monotonic(), 0.0))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the SGLang engine did not come up within {timeout_s:.0f} s")
            watchdog.beat()  # (a start within its bound is progress)
        if self.error is not None:
            raise RuntimeError(f"the SGLang engine failed to start: {self.error}") from self.error
        return self.engine


@dataclass(frozen=True)
class FailedEngine:
    """One engine's failure, as every rank sees it."""
    index: int
    host_rank: int
    phase: str
    reason: str

    def line(self) -> str:
        return f"engine {self.index} (on rank {self.host_rank}) failed in {self.phase}: {self.reason}"


class EnginesGaveUp(RuntimeError):
    """An engine failed more often than ``rollout.max_engine_restarts`` allows."""


class EngineSupervisor:
    """This host's engine: ``start()`` starts it in the background, :meth:`ready` waits for it,
    :meth:`restart` replaces a failed one. ``make_start(name)`` returns an
    :class:`~sparse_rl_mega.rollout.engine.EngineStart` for an engine called ``name``."""

    def __init__(self, index: int, make_start: Callable[[str], EngineStart], *, max_restarts: int,
                 start_timeout_s: float):
        self.index, self.name = index, f"engine {index}"
        self.make_start, self.max_restarts, self.start_timeout_s = make_start, max_restarts, start_timeout_s
        self.restarts = 0  # in this job
        self.engine: Optional[RolloutEngine] = None
        self.starting: Optional[EngineStart] = None
        self.start_seconds: Optional[float] = None  # how long the last start took

    def start(self) -> None:
        self.starting = self.make_start(self.name)

    def ready(self, timeout_s: Optional[float] = None) -> RolloutEngine:
        """Wait (bounded) for the engine that :meth:`start` began."""
        start, self.starting = self.starting, None
        self.engine = start.result(self.start_timeout_s if timeout_s is None else timeout_s)
        self.start_seconds = start.seconds
        return self.engine

    def restart(self, why: str) -> None:
        """Kill the engine's processes and start a fresh one (blocking); the caller gives it weights.
        Raises :class:`EnginesGaveUp` past ``max_restarts``."""
        if self.engine is not None:
            self.engine.kill()
            self.engine = None
        if self.restarts >= self.max_restarts:
            raise EnginesGaveUp(f"{why}; rollout.max_engine_restarts={self.max_restarts} restart(s) already used")
        self.restarts += 1
        self.start()
        self.ready()

    def close(self, wait_s: float) -> None:
        """Shut the engine down; one still starting is waited for up to ``wait_s`` (after that its
        processes die with this one: they ask for SIGKILL when it ends)."""
        if self.starting is not None:
            try:
                self.ready(wait_s)
            except Exception:  # noqa: BLE001 (no engine to shut down)
                pass
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def gather_given(value) -> list:
    """Every rank passes a value (None: nothing to say); all get the non-None values in rank order
    (a collective)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return [v for v in everyone if v is not None]


def agree_on_failures(failure: Optional[EngineFailure], index: Optional[int]) -> list[FailedEngine]:
    """Every rank passes its engine's failure in the current phase (None: none, or no engine); all get
    the list of failed engines."""
    return gather_given(None if failure is None else FailedEngine(index, dist.get_rank(), failure.phase,
                                                                  failure.reason))


def agree_on_errors(error: Optional[str]) -> list[str]:
    """Every rank passes an error of its own (None: none); all get the list, so that a rank's failure to
    recover stops every rank at the same point."""
    return gather_given(error)
