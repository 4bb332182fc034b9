"""KV eviction policies: pure torch, shared by the SGLang engine patch and the reference decoder.

A policy chooses which cached tokens a request keeps when its KV cache is compressed. The public API:

    POLICIES[name](**params).select(keys, window_queries, budget) -> kept indices (ascending)

with ``keys`` ``[kv_heads, length, head_dim]`` (post-RoPE) and ``window_queries``
``[q_heads, window, head_dim]``. Policies whose choice depends only on positions set
``position_only = True``; the engine then compacts a request's row once for all layers.

When to compress (:func:`should_compress`): once the cached length reaches ``budget + interval``,
the request is compressed back to ``budget`` tokens (so the cache swings between B and B + interval).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch


def should_compress(cached_len: int, budget: int, interval: int) -> bool:
    """True when a request with ``cached_len`` tokens in its KV cache must be compressed now."""
    return cached_len >= budget + interval


@dataclass
class EvictionPolicy:
    """Base class. Subclasses implement :meth:`select`; ``__post_init__`` validates parameters."""
    sink: int = 4
    window: int = 8
    position_only: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window <= 0:
            raise ValueError(f"{type(self).__name__}: need sink >= 0 and window > 0, got {self.sink}, {self.window}")

    def select(self, keys: Optional[torch.Tensor], window_queries: Optional[torch.Tensor],
               budget: int, length: Optional[int] = None) -> torch.Tensor:
        raise NotImplementedError

    def check_budget(self, budget: int) -> None:
        if budget <= self.sink + self.window:
            raise ValueError(f"budget {budget} must exceed sink + window = {self.sink + self.window}")


@dataclass
class StreamingPolicy(EvictionPolicy):
    """StreamingLLM: keep the first ``sink`` tokens (attention sinks) and the most recent ones.

    All ``budget - sink`` non-sink slots go to the most recent tokens (``window`` is a lower bound
    that the budget must exceed; for this policy the recent part is always larger)."""
    position_only: ClassVar[bool] = True

    def select(self, keys: Optional[torch.Tensor], window_queries: Optional[torch.Tensor],
               budget: int, length: Optional[int] = None) -> torch.Tensor:
        """Kept token indices ``[budget]`` (ascending) out of ``length`` (or ``keys.shape[1]``)."""
        self.check_budget(budget)
        n = int(length if length is not None else keys.shape[1])
        if n <= budget:
            return torch.arange(n)
        recent = budget - self.sink
        return torch.cat([torch.arange(self.sink), torch.arange(n - recent, n)])


POLICIES: dict[str, type[EvictionPolicy]] = {
    "streaming": StreamingPolicy,
}


def register_policy(name: str, cls: type[EvictionPolicy]) -> None:
    """Make a plugin's policy available to configs and the engine patch under ``name``."""
    if not issubclass(cls, EvictionPolicy):
        raise TypeError(f"{cls} is not an EvictionPolicy")
    POLICIES[name] = cls


def build_policy(name: str, sink: int, window: int, **params) -> EvictionPolicy:
    if name not in POLICIES:
        raise KeyError(f"unknown KV eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name](sink=sink, window=window, **params)
