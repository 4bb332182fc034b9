"""KV eviction policies: pure torch, shared by the SGLang engine patch and the reference decoder.

A policy chooses which cached tokens a request keeps when its KV cache is compressed:

    POLICIES[name](**params).select(keys, window_queries, budget) -> kept indices (ascending)

* ``keys``: ``[kv_heads, length, head_dim]``, post-RoPE, in cache order (oldest first);
* ``window_queries``: ``[q_heads, window, head_dim]``, post-RoPE, the queries of the last ``window``
  decode steps (oldest first); they belong to the last ``window`` cached tokens;
* returns ``[budget]`` indices (one set for the whole layer) or, with ``per_head=True``,
  ``[kv_heads, budget]`` (a set per KV head).

Every policy keeps the first ``sink`` tokens and the ``window`` most recent ones and fills the rest of
the budget with the highest-scoring tokens in between. Scores are ``[kv_heads, length]``; per-layer
selection sums them over KV heads. Policies that score with attention of the window queries need
``window`` decode queries before their first compression (``queries_needed``); H2O scores with the
attention every decode query paid to each key, accumulated by the caller (``accumulated``).

When to compress (:func:`should_compress`): once the cached length reaches ``budget + interval``, the
request is compressed back to ``budget`` tokens (the cache swings between B and B + interval); with
the newline trigger also whenever it is past the budget and the token about to be decoded ends a line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F


def should_compress(cached_len: int, budget: int, interval: int, decode_queries: int = 0,
                    queries_needed: int = 0, at_newline: bool = False) -> bool:
    """True when a request with ``cached_len`` tokens in its KV cache must be compressed now: it
    reached ``budget + interval``, or (newline trigger) it is past the budget and the token about to be
    decoded ends a line (``at_newline``). Scoring policies also need ``queries_needed`` decode queries."""
    due = cached_len >= budget + interval or (at_newline and cached_len > budget)
    return due and decode_queries >= queries_needed


def window_attention(keys: torch.Tensor, window_queries: torch.Tensor) -> torch.Tensor:
    """Softmax attention of the window queries over the keys, ``[q_heads, window, length]`` (float32).

    Query ``i`` of ``w`` belongs to cache position ``length - w + i`` and sees keys up to it (causal
    inside the window; every older key is visible)."""
    q_heads, window, head_dim = window_queries.shape
    kv_heads, length, _ = keys.shape
    group = q_heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=0)  # [q_heads, length, d]
    logits = window_queries.float() @ k.transpose(1, 2) * head_dim ** -0.5  # [q_heads, w, length]
    key_pos = torch.arange(length, device=keys.device)
    query_pos = torch.arange(length - window, length, device=keys.device).unsqueeze(1)
    logits = logits.masked_fill(key_pos.unsqueeze(0) > query_pos, float("-inf"))
    return logits.softmax(dim=-1)


def pool1d(scores: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Same-length 1-D pooling along the last axis of ``[heads, length]`` (odd ``kernel``)."""
    if kernel <= 1:
        return scores
    x = scores.unsqueeze(0)
    if mode == "max":
        return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2).squeeze(0)
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False).squeeze(0)


@dataclass
class EvictionPolicy:
    """Base class: sink + recent window + top scores in between. Subclasses implement :meth:`score`."""
    sink: int = 4
    window: int = 8
    per_head: bool = False
    position_only: ClassVar[bool] = False       # the choice depends on positions only (same for all layers)
    queries_needed: ClassVar[bool] = False      # scores with the last ``window`` decode queries
    needs_accumulated: ClassVar[bool] = False   # scores with accumulated decode attention (H2O)

    def __post_init__(self) -> None:
        if self.sink < 0 or self.window <= 0:
            raise ValueError(f"{type(self).__name__}: need sink >= 0 and window > 0, got {self.sink}, {self.window}")

    @property
    def min_decode_queries(self) -> int:
        return self.window if self.queries_needed else 0

    def check_budget(self, budget: int) -> None:
        if budget <= self.sink + self.window:
            raise ValueError(f"budget {budget} must exceed sink + window = {self.sink + self.window}")

    def score(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor],
              accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[kv_heads, length]``: higher means keep."""
        raise NotImplementedError

    def select(self, keys: Optional[torch.Tensor], window_queries: Optional[torch.Tensor], budget: int,
               length: Optional[int] = None, accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Kept indices, ascending: ``[budget]``, or ``[kv_heads, budget]`` with ``per_head``."""
        return self.select_layers(keys.unsqueeze(0), None if window_queries is None else window_queries.unsqueeze(0),
                                  budget, None if accumulated is None else accumulated.unsqueeze(0))[0]

    def select_layers(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor], budget: int,
                      accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`select` for several layers at once: ``keys [layers, kv_heads, length, d]``,
        ``window_queries [layers, q_heads, w, d]``, ``accumulated [layers, kv_heads, length]`` ->
        ``[layers, budget]`` (or ``[layers, kv_heads, budget]``). Ties go to the older token (stable
        sort), so the choice does not depend on how many layers are selected together."""
        self.check_budget(budget)
        layers, kv_heads, n, head_dim = keys.shape
        if n <= budget:
            kept = torch.arange(n, device=keys.device)
            return kept.expand(layers, kv_heads, n).clone() if self.per_head else kept.expand(layers, n).clone()
        flat_queries = None if window_queries is None else window_queries.reshape(-1, *window_queries.shape[2:])
        flat_accumulated = None if accumulated is None else accumulated.reshape(-1, n)
        # layers x heads flatten into one head axis: the GQA grouping stays aligned (layer-major)
        scores = self.score(keys.reshape(-1, n, head_dim), flat_queries, flat_accumulated).view(layers, kv_heads, n)
        scores = scores[..., self.sink:n - self.window].float()
        if not self.per_head:
            scores = scores.sum(dim=1)  # [layers, middle]
        free = budget - self.sink - self.window
        top = scores.argsort(dim=-1, descending=True, stable=True)[..., :free]
        on = keys.device
        forced = torch.cat([torch.arange(self.sink, device=on), torch.arange(n - self.window, n, device=on)])
        middle = torch.arange(self.sink, n - self.window, device=on)
        kept = torch.cat([forced.expand(*top.shape[:-1], -1), middle[top]], dim=-1)
        return kept.sort(dim=-1).values


@dataclass
class StreamingPolicy(EvictionPolicy):
    """StreamingLLM: the first ``sink`` tokens (attention sinks) and the most recent ones; every
    non-sink slot of the budget goes to recent tokens."""
    position_only: ClassVar[bool] = True

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        raise NotImplementedError("streaming selects by position")

    def select(self, keys, window_queries, budget, length=None, accumulated=None) -> torch.Tensor:
        self.check_budget(budget)
        n = int(length if length is not None else keys.shape[1])
        if n <= budget:
            return torch.arange(n)
        return torch.cat([torch.arange(self.sink), torch.arange(n - (budget - self.sink), n)])


@dataclass
class SnapKVPolicy(EvictionPolicy):
    """SnapKV: attention of the last ``window`` queries to each key, averaged over the window and the
    GQA group's query heads, then pooled along the sequence (``pool`` over ``kernel`` neighbours)."""
    kernel: int = 7
    pool: str = "max"
    queries_needed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel < 1 or self.kernel % 2 == 0 or self.pool not in ("max", "avg"):
            raise ValueError(f"SnapKV: kernel must be odd and >= 1, pool max|avg; got {self.kernel}, {self.pool}")

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        probs = window_attention(keys, window_queries)  # [q_heads, w, length]
        kv_heads = keys.shape[0]
        per_kv_head = probs.mean(dim=1).view(kv_heads, -1, keys.shape[1]).mean(dim=1)
        return pool1d(per_kv_head, self.kernel, self.pool)


@dataclass
class RKVPolicy(EvictionPolicy):
    """R-KV: ``score = lam * importance - (1 - lam) * redundancy``.

    importance: max-pooled (``kernel``) mean attention of the window queries to each key, max over
    the GQA group's query heads; redundancy: softmax over keys of each key's mean cosine similarity to
    the other keys (diagonal zeroed), where a key with no later near-duplicate (similarity above
    ``similarity_threshold``) counts as not redundant (the most recent copy is protected)."""
    lam: float = 0.1
    kernel: int = 7
    similarity_threshold: float = 0.5
    queries_needed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lam <= 1.0 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"R-KV: need 0 <= lam <= 1 and an odd kernel, got {self.lam}, {self.kernel}")

    def importance(self, keys, window_queries) -> torch.Tensor:
        probs = window_attention(keys, window_queries).mean(dim=1)  # [q_heads, length]
        grouped = probs.view(keys.shape[0], -1, keys.shape[1]).amax(dim=1)
        return pool1d(grouped, self.kernel, "max")

    def redundancy(self, keys) -> torch.Tensor:
        unit = F.normalize(keys.float(), dim=-1)
        sim = unit @ unit.transpose(1, 2)  # [kv_heads, length, length]
        length = keys.shape[1]
        sim = sim * (1.0 - torch.eye(length, device=keys.device))
        later = torch.triu(torch.ones(length, length, dtype=torch.bool, device=keys.device), diagonal=1)
        has_later_duplicate = ((sim > self.similarity_threshold) & later).any(dim=-1)  # [kv_heads, length]
        sim = sim * has_later_duplicate.unsqueeze(-1)
        return (sim.sum(dim=-1) / max(length - 1, 1)).softmax(dim=-1)

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        return self.lam * self.importance(keys, window_queries) - (1.0 - self.lam) * self.redundancy(keys)


@dataclass
class H2OPolicy(EvictionPolicy):
    """H2O (heavy hitters): the attention each key received from every decode query so far (summed
    over the GQA group's query heads), accumulated by the caller and carried across compressions."""
    needs_accumulated: ClassVar[bool] = True

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        if accumulated is None:
            raise ValueError("H2O needs the accumulated attention [kv_heads, length]")
        return accumulated


POLICIES: dict[str, type[EvictionPolicy]] = {
    "streaming": StreamingPolicy,
    "snapkv": SnapKVPolicy,
    "rkv": RKVPolicy,
    "h2o": H2OPolicy,
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


def decode_attention_mass(keys: torch.Tensor, query: torch.Tensor, scaling: float,
                          lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention one decode query pays to every cached key, summed over each KV head's query group:
    ``keys [..., kv_heads, length, d]``, ``query [..., q_heads, d]`` -> ``[..., kv_heads, length]``
    (float32). With a batch dimension, ``lengths [n]`` masks each request's keys past its length.
    H2O adds this up over decode steps."""
    kv_heads, length = keys.shape[-3], keys.shape[-2]
    group = query.shape[-2] // kv_heads
    k = keys.float().repeat_interleave(group, dim=-3)  # [..., q_heads, length, d]
    logits = (k @ query.float().unsqueeze(-1)).squeeze(-1) * scaling  # [..., q_heads, length]
    if lengths is not None:
        beyond = torch.arange(length, device=keys.device) >= lengths.unsqueeze(-1)  # [n, length]
        logits = logits.masked_fill(beyond.unsqueeze(-2), float("-inf"))
    probs = logits.softmax(dim=-1)
    return probs.unflatten(-2, (kv_heads, group)).sum(dim=-2)


def window_attention_mass(keys: torch.Tensor, queries: torch.Tensor, scaling: float, lengths: torch.Tensor,
                          counts: torch.Tensor) -> torch.Tensor:
    """Attention mass that each request's last ``counts[r]`` decode queries paid to every cached key,
    summed over those queries and over each KV head's query group: what :func:`decode_attention_mass`
    adds up step by step, computed for several steps at once (the keys of a request only grow between
    compressions, so every step's keys are still in the cache).

    ``keys [n, kv_heads, L, d]`` (``L`` >= every length), ``queries [n, q_heads, w, d]`` oldest first,
    of which the last ``counts[r]`` (<= w) are real; query ``i`` belongs to cache position
    ``lengths[r] - w + i`` and saw the keys up to it. Returns ``[n, kv_heads, L]`` (float32)."""
    n, kv_heads, width, head_dim = keys.shape
    q_heads, w = queries.shape[1], queries.shape[2]
    group = q_heads // kv_heads
    q = queries.float().reshape(n, kv_heads, group * w, head_dim)  # query head h serves KV head h // group
    logits = (q @ keys.float().transpose(-1, -2) * scaling).view(n, kv_heads, group, w, width)
    on = keys.device
    query_pos = lengths.unsqueeze(1) - w + torch.arange(w, device=on)  # [n, w]
    visible = torch.arange(width, device=on) <= query_pos.unsqueeze(-1)  # [n, w, L]; also hides keys past a length
    real = torch.arange(w, device=on) >= (w - counts).unsqueeze(1)  # [n, w]
    visible &= real.unsqueeze(-1)
    visible[..., 0] |= ~real  # padding queries see one key (no NaN); their rows are zeroed below
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1)
    probs = probs * real[:, None, None, :, None]
    return probs.sum(dim=(2, 3))


def compression_schedule(prompt_len: int, response_len: int, budget: int, interval: int,
                         queries_needed: int = 0, newline_at: Optional[list[bool]] = None) -> tuple[int, int]:
    """``(compressions, evicted_tokens)`` of one request, from lengths alone.

    Replays the trigger of :func:`should_compress` over the request's decode steps (the first response
    token comes from the prefill; decode step ``t`` feeds response token ``t - 1``); ``newline_at[t]``
    says whether response token ``t`` ends a line (newline trigger). The engine follows the same rule,
    except when it has to postpone a compression for lack of free slots."""
    cached, compressions, evicted = prompt_len, 0, 0
    for step in range(1, response_len):
        at_newline = bool(newline_at[step - 1]) if newline_at is not None else False
        if should_compress(cached, budget, interval, step - 1, queries_needed, at_newline):
            evicted += cached - budget
            cached = budget
            compressions += 1
        cached += 1
    return compressions, evicted
