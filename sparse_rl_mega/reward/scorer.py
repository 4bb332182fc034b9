"""Batch reward scoring: ``build_scorer(reward_cfg).score(responses, labels) -> list[float]``.

``reward = correct + format_weight * has_box`` where ``correct`` is 1.0 or 0.0 and ``has_box`` says
whether the response holds a complete ``\\boxed{}`` / ``\\fbox{}`` answer (``format_weight`` defaults
to 0: the reward is exactly the correctness).

* ``exact_answer``: :func:`~sparse_rl_mega.reward.exact.exact_answer_reward`, in process.
* ``math``: answers extracted here (:mod:`sparse_rl_mega.reward.math`); pairs that plain string or
  integer comparison cannot settle are checked with math-verify in a small pool of worker processes,
  sent in chunks. The workers (:mod:`sparse_rl_mega.reward.math_worker`) are children of this process's
  warm server (``runtime/warm_fork.py``), which imported math-verify and warmed it once: a worker
  replacing one costs a fork, not ~1.5 CPU-s of imports. Each item has ``timeout_s`` from the moment its
  worker starts it: a worker past the limit is killed (SIGKILL) and replaced, the item scores 0 and is
  counted in ``stats.timeouts``; the rest of its chunk goes to another worker. The workers die with the
  server, which dies with this process; :meth:`Scorer.close` stops them.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, fields
from typing import Optional

from sparse_rl_mega.reward import math as math_answer
from sparse_rl_mega.reward import math_worker
from sparse_rl_mega.runtime import warm_fork
from sparse_rl_mega.runtime.warm_fork import Descriptor, WarmProcess
from sparse_rl_mega.reward.exact import exact_answer_reward, extract_final_number

WORKER_MEMORY_MB = 2048      # address-space limit of a worker (RLIMIT_AS); a runaway sympy gets MemoryError
WORKER_STARTUP_S = 120.0     # a worker that is not ready by then is an error (import problem, overload)
CHUNK_MAX = 16               # items per message to a worker


@dataclass
class ScorerStats:
    """Counters over scored items (``Scorer.stats``: since creation; ``Scorer.last_stats``: last call)."""
    items: int = 0
    correct: int = 0
    format_hits: int = 0        # responses with a complete \boxed{} / \fbox{} answer
    no_answer: int = 0          # nothing extracted (no box and no fallback answer)
    parse_failures: int = 0     # an answer math-verify could not parse, or too long / too deeply nested
    label_failures: int = 0     # a label without a usable answer (a data problem)
    timeouts: int = 0           # items whose worker was killed at the time limit
    worker_errors: int = 0      # items whose check raised or whose worker died
    worker_checks: int = 0      # items sent to workers (the rest were settled by string / integer equality)
    seconds: float = 0.0

    def add(self, other: ScorerStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        n = max(self.items, 1)
        return {
            f"{prefix}accuracy": self.correct / n,
            f"{prefix}format_fraction": self.format_hits / n,
            f"{prefix}no_answer_fraction": self.no_answer / n,
            f"{prefix}parse_failures": float(self.parse_failures + self.label_failures),
            f"{prefix}timeouts": float(self.timeouts),
            f"{prefix}worker_errors": float(self.worker_errors),
        }


class Scorer:
    """Scores batches of (response, label); a context manager. Not for concurrent use from several threads
    (calls are serialised by a lock)."""

    def __init__(self, format_weight: float = 0.0) -> None:
        self.format_weight = float(format_weight)
        self.stats = ScorerStats()
        self.last_stats = ScorerStats()
        self._lock = threading.Lock()
        self._closed = False

    def score(self, responses: list[str], labels: list[str]) -> list[float]:
        """One reward per response: ``correct + format_weight * has_box``."""
        correct, boxed = self.judge(responses, labels)
        return [float(c) + self.format_weight * float(b) for c, b in zip(correct, boxed)]

    def judge(self, responses: list[str], labels: list[str]) -> tuple[list[bool], list[bool]]:
        """Per response: (is the answer correct, does it hold a complete box); updates the stats."""
        if len(responses) != len(labels):
            raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
        with self._lock:
            if self._closed:
                raise RuntimeError("this scorer is closed")
            started = time.perf_counter()
            stats = ScorerStats(items=len(responses))
            correct, boxed = self._correct([str(r) for r in responses], [str(x) for x in labels], stats)
            stats.correct = sum(correct)
            stats.format_hits = sum(boxed)
            stats.seconds = time.perf_counter() - started
            self.last_stats = stats
            self.stats.add(stats)
        return correct, boxed

    def _correct(self, responses: list[str], labels: list[str], stats: ScorerStats) -> tuple[list[bool], list[bool]]:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ExactAnswerScorer(Scorer):
    """``exact_answer``: the final number equals the label's (in process, no workers)."""

    def _correct(self, responses, labels, stats):
        correct, boxed = [], []
        for response, label in zip(responses, labels):
            if extract_final_number(label) is None:
                stats.label_failures += 1
            elif extract_final_number(response) is None:
                stats.no_answer += 1
            correct.append(exact_answer_reward(response, label) == 1.0)
            boxed.append(math_answer.last_boxed(response) is not None)
        return correct, boxed


class _Worker:
    """A worker (``math_worker.serve_items``, a child of the warm server) and its two pipes."""

    def __init__(self, memory_mb: int) -> None:
        items_r, self.items_w = os.pipe()
        self.fd, answers_w = os.pipe()
        self.process = WarmProcess(target=math_worker.serve_items, daemon=True, name="math-reward-worker",
                                   args=(Descriptor(items_r), Descriptor(answers_w), memory_mb))
        try:
            self.process.start()
        finally:
            os.close(items_r)
            os.close(answers_w)
        self.buffer = b""
        self.ready = False
        self.spawned = time.monotonic()
        self.queue: list = []  # the items of the current chunk not answered yet; queue[0] is running
        self.started = 0.0     # when queue[0] started

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self, timeout: float) -> Optional[int]:
        """Its exit code once it has ended (waiting up to ``timeout`` s), else None."""
        self.process.join(timeout)
        return self.process.exitcode

    def write(self, data: bytes) -> None:
        """Send ``data`` to the worker (a dead one: BrokenPipeError)."""
        while data:
            data = data[os.write(self.items_w, data):]

    def close(self) -> None:
        for fd in (self.items_w, self.fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def kill(self) -> None:
        self.close()
        _kill(self.pid)


def _kill(pid: Optional[int]) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)  # (reaped by the warm server)
        except ProcessLookupError:
            pass


def _stop_workers(workers: list, owner_pid: int) -> None:
    """Kill every worker (they hold no state); only in the process that started them."""
    if os.getpid() != owner_pid:
        return
    pids = [w.pid for w in workers]
    for w in workers:
        w.close()
    workers.clear()
    for pid in pids:
        _kill(pid)
    deadline = time.monotonic() + 5.0  # (not our children: gone once the kernel has delivered SIGKILL)
    while any(warm_fork.running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


class MathScorer(Scorer):
    """``math``: extraction here, math-verify equivalence in ``workers`` processes, ``timeout_s`` per item."""

    def __init__(self, timeout_s: float = 2.0, workers: int = 2, fallback: str = "answer_is_or_last_number",
                 format_weight: float = 0.0, memory_mb: int = WORKER_MEMORY_MB) -> None:
        super().__init__(format_weight)
        if fallback not in math_answer.FALLBACKS:
            raise ValueError(f"fallback must be one of {math_answer.FALLBACKS}, got {fallback!r}")
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"need timeout_s > 0 and workers >= 1, got {timeout_s}, {workers}")
        self.timeout_s = float(timeout_s)
        self.fallback = fallback
        self.memory_mb = int(memory_mb)
        self._owner_pid = os.getpid()
        self._selector = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._startup_deaths = 0
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, self._owner_pid)
        warm_fork.start_server([f"{math_worker.__name__}:warm_up"])  # (one runs already: it serves)
        for _ in range(workers):
            self._spawn()

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def wait_ready(self, timeout: float = WORKER_STARTUP_S) -> None:
        """Block until every worker has math-verify loaded (e.g. after replacements; ``score`` waits by itself)."""
        with self._lock:
            deadline = time.monotonic() + timeout
            while not all(w.ready for w in self._workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"math reward workers not ready after {timeout:.0f} s")
                for key, _ in self._selector.select(left):
                    if key.data in self._workers:
                        self._read(key.data, {}, deque())

    # ------------------------------------------------------------------ pool
    def _spawn(self) -> _Worker:
        w = _Worker(self.memory_mb)
        self._workers.append(w)
        self._selector.register(w.fd, selectors.EVENT_READ, w)
        return w

    def _retire(self, w: _Worker) -> None:
        self._selector.unregister(w.fd)
        self._workers.remove(w)
        w.kill()

    def _replace(self, w: _Worker) -> None:
        self._retire(w)
        self._spawn()

    def _lost(self, w: _Worker, results: dict, chunks: deque, status: str) -> None:
        """``w`` timed out or died: its running item gets ``status``, the rest of its chunk is queued again."""
        if w.queue:
            idx = w.queue[0][0]
            results[idx] = (False, status)
            if w.queue[1:]:
                chunks.appendleft(w.queue[1:])
        w.queue = []
        self._replace(w)

    def _send(self, w: _Worker, chunk: list, chunks: deque) -> None:
        w.queue = list(chunk)
        w.started = time.monotonic()
        try:
            w.write(json.dumps(chunk).encode() + b"\n")
        except (BrokenPipeError, OSError):  # died while idle: nothing of the chunk ran
            chunks.appendleft(w.queue)
            w.queue = []
            self._replace(w)

    def _read(self, w: _Worker, results: dict, chunks: deque) -> None:
        data = os.read(w.fd, 1 << 16)
        if not data:
            if not w.ready:
                self._startup_deaths += 1
                code = w.exit_code(timeout=5)
                if (code is not None and code > 0) or self._startup_deaths >= 3:
                    raise RuntimeError(f"math reward worker exited with code {code} during startup "
                                       "(its stderr is above); is math-verify installed?")
            self._lost(w, results, chunks, "crash")
            return
        w.buffer += data
        *lines, w.buffer = w.buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if message == "ready":
                w.ready = True
                self._startup_deaths = 0
                continue
            idx, ok, status = message
            if not w.queue or w.queue[0][0] != idx:
                raise RuntimeError(f"math reward worker answered item {idx} out of order")
            w.queue.pop(0)
            results[idx] = (bool(ok), status)
            w.started = time.monotonic()

    def _check(self, pending: list) -> dict:
        """math-verify verdicts {index: (correct, status)} for [(index, pred, gold)], bounded per item."""
        results: dict = {}
        if not pending:
            return results
        size = max(1, min(CHUNK_MAX, -(-len(pending) // (2 * len(self._workers)))))
        chunks = deque(pending[i:i + size] for i in range(0, len(pending), size))
        while chunks or any(w.queue for w in self._workers):
            for w in list(self._workers):
                if w.ready and not w.queue and chunks:
                    self._send(w, chunks.popleft(), chunks)
            now = time.monotonic()
            deadlines = [w.started + self.timeout_s for w in self._workers if w.queue]
            deadlines += [w.spawned + WORKER_STARTUP_S for w in self._workers if not w.ready]
            wait = max(0.0, min(deadlines) - now) if deadlines else None
            for key, _ in self._selector.select(wait):
                if key.data in self._workers:
                    self._read(key.data, results, chunks)
            now = time.monotonic()
            for w in list(self._workers):
                if w.queue and now - w.started > self.timeout_s:
                    self._lost(w, results, chunks, "timeout")
                elif not w.ready and now - w.spawned > WORKER_STARTUP_S:
                    raise RuntimeError(f"math reward worker not ready after {WORKER_STARTUP_S:.0f} s")
        return results

    # ------------------------------------------------------------------ scoring
    def _correct(self, responses, labels, stats):
        n = len(responses)
        correct, boxed = [False] * n, [False] * n
        pending = []
        for i, (response, label) in enumerate(zip(responses, labels)):
            extracted = math_answer.extract_answer(response, self.fallback)
            boxed[i] = extracted.boxed
            gold = math_answer.extract_label(label)
            if gold is None or math_answer.too_complex(gold):
                stats.label_failures += 1
                continue
            if extracted.answer is None:
                stats.no_answer += 1
                continue
            pred, gold = math_answer.normalize(extracted.answer), math_answer.normalize(gold)
            if not pred:
                stats.no_answer += 1
                continue
            quick = math_answer.quick_verdict(pred, gold)
            if quick is not None:
                correct[i] = quick
            elif math_answer.too_complex(pred):
                stats.parse_failures += 1
            else:
                pending.append((i, pred, gold))
        stats.worker_checks = len(pending)
        for i, (ok, status) in self._check(pending).items():
            correct[i] = ok
            if status == "timeout":
                stats.timeouts += 1
            elif status == "pred_parse":
                stats.parse_failures += 1
            elif status == "label_parse":
                stats.label_failures += 1
            elif status in ("error", "crash"):
                stats.worker_errors += 1
        return correct, boxed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                self._selector.unregister(w.fd)
            self._finalizer()  # stops the workers (once)
            self._selector.close()


def build_scorer(reward_cfg) -> Scorer:
    """The scorer of a :class:`~sparse_rl_mega.config.RewardConfig` (close it, or use it in ``with``)."""
    kind = getattr(reward_cfg, "type", "exact_answer")
    weight = getattr(reward_cfg, "format_weight", 0.0)
    if kind == "exact_answer":
        return ExactAnswerScorer(format_weight=weight)
    if kind == "math":
        return MathScorer(timeout_s=getattr(reward_cfg, "timeout_s", 2.0), workers=getattr(reward_cfg, "workers", 2),
                          fallback=getattr(reward_cfg, "fallback", "answer_is_or_last_number"), format_weight=weight)
    raise ValueError(f"unknown reward type {kind!r}; expected exact_answer or math")


_default: Optional[MathScorer] = None
_default_lock = threading.Lock()


def default_scorer() -> MathScorer:
    """The module-level math scorer behind ``math_reward`` (default limit; created on first use, per process)."""
    global _default
    with _default_lock:
        if _default is None or _default._owner_pid != os.getpid() or _default._closed:
            _default = MathScorer()
        return _default


def math_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer is mathematically equal to the label's, else 0.0.

    Uses a module-level :class:`~sparse_rl_mega.reward.scorer.Scorer` (2 workers, 2 s per check),
    started on first use and closed at exit; batches should use ``build_scorer(...).score``."""
    return default_scorer().score([response], [label])[0]
