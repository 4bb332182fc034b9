"""What the loop prints and times: rank 0's lines, an iteration's progress line, durations as a person
reads them, each iteration's phase times (the timeline) and where start-up or shut-down went."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist

from sparse_rl_mega.runtime import watchdog


def log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []  # (phase, start, end) wall times: the timeline

    @contextmanager
    def phase(self, name: str):
        start, wall = time.perf_counter(), time.time()
        watchdog.enter(name)
        try:
            yield
        except BaseException:
            watchdog.leave(name, completed=False)  # (a failed phase's time is no measure of the phase)
            raise
        watchdog.leave(name)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        self.spans.append((name, wall, time.time()))

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}_s": value for name, value in self.seconds.items()}


class PhaseClock:
    """Wall seconds of consecutive named phases (where start-up or shut-down went), the first counted
    from ``started_at`` (``time.time()``; for start-up the launcher's start); printed as one line."""

    def __init__(self, started_at: Optional[float] = None) -> None:
        self.started_at = self.last = started_at if started_at is not None else time.time()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """The time since the previous mark was spent on ``name``."""
        now = time.time()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now
        watchdog.beat()  # (a start-up step done)

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases.items() if seconds >= 0.05)
        return f"{self.last - self.started_at:.1f} s" + (f" ({parts})" if parts else "")


def duration(seconds: float) -> str:
    """``42 s``, ``3m 05s``, ``2h 03m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def progress_line(iteration: int, total: int, m: dict[str, float]) -> str:
    return (f"[iter {iteration + 1}/{total}] reward {m['reward/mean']:.3f} | loss {m['train/loss']:+.4f} | "
            f"veto {m['correction/veto_fraction']:.3f} rej {m['correction/token_rejected_fraction']:.3f} "
            f"(rho<1 {m['correction/token_rejected_low_fraction']:.3f}) | "
            f"IS mean {m['correction/is_weight_mean']:.3f} max {m['correction/is_weight_max']:.2f} | "
            f"k3 {m['mismatch/k3']:.4f} | "
            + (f"budget {m['kv/budget']:.0f} " if "kv/budget" in m else "")
            + f"evicted/sample {m['kv/evicted_tokens_per_sample']:.1f} "
            f"peak KV {m['kv/peak_slots_in_use']:.0f} | sync diff {m.get('sync/max_abs_logprob_diff', float('nan')):.1e} | "
            f"{m['time/iteration_s']:.1f} s"
            + (f" (samples {m['rollout/staleness_mean']:.1f} versions old, learner waited {m['time/learner_wait_s']:.1f} s)"
               if m.get("rollout/staleness_max") else ""))
