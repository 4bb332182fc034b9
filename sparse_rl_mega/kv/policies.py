"""KV eviction policies: pure torch, shared by the SGLang engine patch and the reference decoder.

A policy chooses which cached tokens a request keeps when its KV cache is compressed. The scoring
policies follow the published code (docs/kv_compression.md lists every difference):

* ``snapkv``: the importance of the paper's release (``r1kv_utils.py``) and of R-KV's own SnapKV;
* ``rkv``: R-KV, ``lam * importance - (1 - lam) * redundancy`` (release and R-KV's ``r1_kv.py``);
* ``h2o``: the attention every decode query paid to a key, accumulated by the caller;
* ``streaming``: StreamingLLM, by position only.

Inputs (post-RoPE, cache order, oldest first):

* ``keys``: ``[kv_heads, length, head_dim]``;
* ``window_queries``: ``[q_heads, window, head_dim]``, the queries of the last ``window`` decode steps,
  which belong to the last ``window`` cached tokens;
* ``accumulated`` (H2O): ``[kv_heads, length]``.

:meth:`EvictionPolicy.score` scores the keys *before* the window, ``[kv_heads, length - window]``: the
``window`` most recent tokens are always kept and never scored (the published code leaves them out of
the softmax). The kept set is ``sink`` first tokens (0 in the published R-KV / SnapKV code) + the
highest-scoring older tokens + the window, chosen by ``selection``:

* ``per_layer``: one set per layer, scores summed over the layer's KV heads;
* ``per_head``: one set per KV head of every layer (R-KV's own code);
* ``shared``: one set per request for every layer (the paper's release): scores of the first layer
  summed over its KV heads (``shared_scores: first_layer``, the release) or summed over all layers
  (``layer_sum``). The engine then compacts the request's row: no K/V is copied.

With an engine at TP > 1, each rank scores its own KV heads; ``gather_heads`` collects every head's
scores before a per-layer or shared choice, so the choice does not depend on the engine's TP.

When to compress (:func:`should_compress`): once the cached length reaches ``budget + interval``, the
request is compressed back to ``budget`` tokens (the cache swings between B and B + interval); with
the newline trigger also whenever it is past the budget and the token about to be decoded ends a line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
import torch.nn.functional as F

SELECTIONS = ("per_layer", "per_head", "shared")
SHARED_SCORES = ("first_layer", "layer_sum")
GQA_POOLS = ("max", "mean")
POOLS = ("max", "avg")


def should_compress(cached_len: int, budget: int, interval: int, decode_queries: int = 0,
                    queries_needed: int = 0, at_newline: bool = False) -> bool:
    """True when a request with ``cached_len`` tokens in its KV cache must be compressed now: it
    reached ``budget + interval``, or (newline trigger) it is past the budget and the token about to be
    decoded ends a line (``at_newline``). Scoring policies also need ``queries_needed`` decode queries."""
    due = cached_len >= budget + interval or (at_newline and cached_len > budget)
    return due and decode_queries >= queries_needed


def window_logits(keys: torch.Tensor, window_queries: torch.Tensor, gqa_pool: str = "max") -> torch.Tensor:
    """Attention logits of the window queries, pooled over each KV head's query group *before* any
    softmax (max or mean, as the published ``compute_attention_scores``): ``[kv_heads, window, length]``
    (float32), scaled by ``1 / sqrt(head_dim)``. ``kv_heads`` may hold several layers' heads, layer-major,
    with the queries in the same order."""
    kv_heads, length, head_dim = keys.shape
    q_heads, window, _ = window_queries.shape
    group = q_heads // kv_heads
    q = window_queries.float().reshape(kv_heads, group * window, head_dim)
    # one batched matmul per KV head (a broadcast matmul over the group axis costs ~3x on CPU)
    logits = torch.bmm(q, keys.float().transpose(-1, -2)) * head_dim ** -0.5  # [kv_heads, group * w, length]
    logits = logits.view(kv_heads, group, window, length)
    return logits.amax(dim=1) if gqa_pool == "max" else logits.mean(dim=1)


def pool1d(scores: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Same-length pooling along the last axis of ``[heads, length]`` with ``kernel // 2`` padding on each
    side, as ``F.max_pool1d`` / ``F.avg_pool1d`` in the published code (the average counts the padding
    zeros at both ends)."""
    if kernel <= 1:
        return scores
    x = scores.unsqueeze(1)
    if mode == "max":
        return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2).squeeze(1)
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2).squeeze(1)


def window_importance(keys: torch.Tensor, window_queries: torch.Tensor, gqa_pool: str, kernel: int,
                      pool: str) -> torch.Tensor:
    """Importance of the keys before the window, ``[kv_heads, length - window]`` (float32): the pooled
    logits of the window queries, softmax over those older keys only (the window's own keys are left
    out), mean over the window's queries, then pooled along the sequence."""
    length, window = keys.shape[1], window_queries.shape[1]
    probs = window_logits(keys, window_queries, gqa_pool)[..., :length - window].softmax(dim=-1).mean(dim=1)
    return pool1d(probs, kernel, pool)


def key_redundancy(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy of every key, ``[kv_heads, length]`` (float32, a softmax over keys).

    Cosine similarity ``S`` of the keys (``k / (|k| + 1e-8)``) with the diagonal zeroed; for each key ``i``
    only the entry ``S[i, j]`` of its last near-duplicate (the largest ``j`` with ``S[i, j] > threshold``;
    ``j = 0`` when it has none) is zeroed; the redundancy of key ``j`` is the mean of column ``j`` over all
    rows, followed by a softmax over the keys."""
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(-1, -2)  # [kv_heads, length, length]
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    above = sim > threshold  # one byte per pair (the published code builds an int64 index matrix here)
    length = sim.shape[-1]
    # max over a row gives the first maximal index: the first True from the end, and whether there is one
    has_duplicate, from_end = above.flip(-1).max(dim=-1)  # [kv_heads, L]
    last_duplicate = torch.where(has_duplicate, length - 1 - from_end, torch.zeros_like(from_end))
    del above
    sim.scatter_(-1, last_duplicate.unsqueeze(-1), 0.0)
    return sim.mean(dim=-2).softmax(dim=-1)


@dataclass
class EvictionPolicy:
    """Base class: ``sink`` first tokens + the top-scoring older tokens + the ``window`` most recent ones.
    Subclasses implement :meth:`score`."""
    sink: int = 4
    window: int = 8
    selection: str = "per_layer"
    shared_scores: str = "first_layer"
    position_only: ClassVar[bool] = False       # the choice depends on positions only (same for all layers)
    queries_needed: ClassVar[bool] = False      # scores with the last ``window`` decode queries
    needs_accumulated: ClassVar[bool] = False   # scores with accumulated decode attention (H2O)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.sink < 0 or self.window <= 0:
            raise ValueError(f"{name}: need sink >= 0 and window > 0, got {self.sink}, {self.window}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"{name}: selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.shared_scores not in SHARED_SCORES:
            raise ValueError(f"{name}: shared_scores must be one of {', '.join(SHARED_SCORES)}, "
                             f"got {self.shared_scores!r}")

    @classmethod
    def waits_for_window(cls) -> bool:
        """Whether a request's first compression waits for ``window`` decode steps: the policy scores
        with their queries or (H2O) with the attention they paid; without them it would choose on
        nothing (all-zero scores keep the oldest tokens)."""
        return cls.queries_needed or cls.needs_accumulated

    @property
    def min_decode_queries(self) -> int:
        return self.window if self.waits_for_window() else 0

    @property
    def shared(self) -> bool:
        """One kept set for every layer of a request (the engine compacts the row, copies nothing)."""
        return self.position_only or self.selection == "shared"

    def scored_layers(self, layers: int) -> int:
        """How many layers (the first ones) the choice reads: 1 for ``shared`` from the first layer."""
        return 1 if self.selection == "shared" and self.shared_scores == "first_layer" else layers

    def check_budget(self, budget: int) -> None:
        if budget <= self.sink + self.window:
            raise ValueError(f"budget {budget} must exceed sink + window = {self.sink + self.window}")

    def score(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor],
              accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[kv_heads, length - window]``: scores of the keys before the window, higher means keep."""
        raise NotImplementedError

    def choose(self, scores: torch.Tensor, budget: int,
               gather_heads: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Kept indices (ascending) from ``scores [n, layers, kv_heads, length - window]``:
        ``[n, layers, kv_heads, budget]`` per head, ``[n, layers, budget]`` per layer, ``[n, budget]``
        shared (``layers`` is 1 when shared from the first layer). ``gather_heads`` maps this TP rank's
        heads to every head (axis 2) before they are summed. Ties go to the older token (stable sort)."""
        self.check_budget(budget)
        scored = scores.shape[-1]
        length = scored + self.window
        if self.selection != "per_head":
            if gather_heads is not None:
                scores = gather_heads(scores)
            scores = scores.sum(dim=2)  # [n, layers, M]
            if self.selection == "shared":
                scores = scores.sum(dim=1)  # [n, M]
        free = budget - self.sink - self.window
        on = scores.device
        top = scores[..., self.sink:].argsort(dim=-1, descending=True, stable=True)[..., :free] + self.sink
        forced = torch.cat([torch.arange(self.sink, device=on), torch.arange(scored, length, device=on)])
        kept = torch.cat([forced.expand(*top.shape[:-1], -1), top], dim=-1)
        return kept.sort(dim=-1).values

    def select_layers(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor], budget: int,
                      accumulated: Optional[torch.Tensor] = None,
                      gather_heads: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Kept indices of ``n`` requests: ``keys [n, layers, kv_heads, length, d]``, ``window_queries
        [n, layers, q_heads, w, d]``, ``accumulated [n, layers, kv_heads, length]`` (only the first
        :meth:`scored_layers` layers are read) -> see :meth:`choose`."""
        n, layers, kv_heads, length, head_dim = keys.shape
        if length <= budget:
            shape = {"per_head": (n, layers, kv_heads), "per_layer": (n, layers), "shared": (n,)}[self.selection]
            return torch.arange(length, device=keys.device).expand(*shape, length).clone()
        used = self.scored_layers(layers)
        flat_queries = None
        if window_queries is not None:
            flat_queries = window_queries[:, :used].reshape(-1, *window_queries.shape[-2:])
        flat_accumulated = None if accumulated is None else accumulated[:, :used].reshape(-1, length)
        # requests x layers x heads flatten into one head axis: the GQA grouping stays aligned
        scores = self.score(keys[:, :used].reshape(-1, length, head_dim), flat_queries, flat_accumulated)
        return self.choose(scores.float().view(n, used, kv_heads, -1), budget, gather_heads)

    def select(self, keys: Optional[torch.Tensor], window_queries: Optional[torch.Tensor], budget: int,
               length: Optional[int] = None, accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One layer of one request: ``[budget]``, or ``[kv_heads, budget]`` per head."""
        kept = self.select_layers(keys[None, None], None if window_queries is None else window_queries[None, None],
                                  budget, None if accumulated is None else accumulated[None, None])
        return kept[0] if self.selection == "shared" else kept[0, 0]


@dataclass
class StreamingPolicy(EvictionPolicy):
    """StreamingLLM: the first ``sink`` tokens (attention sinks) and the most recent ones; every
    non-sink slot of the budget goes to recent tokens. The same tokens in every layer and head."""
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
    """SnapKV as the paper's release and R-KV's repository compute it: :func:`window_importance` (logits
    pooled over the GQA group with ``gqa_pool``, softmax over the keys before the window, mean over the
    window's queries, ``pool`` over ``kernel`` neighbours). Original SnapKV pools with ``avg``."""
    kernel: int = 7
    pool: str = "max"
    gqa_pool: str = "max"
    queries_needed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel < 1 or self.kernel % 2 == 0 or self.pool not in POOLS or self.gqa_pool not in GQA_POOLS:
            raise ValueError(f"{type(self).__name__}: kernel must be odd and >= 1, pool max|avg, gqa_pool max|mean; "
                             f"got {self.kernel}, {self.pool}, {self.gqa_pool}")

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        return window_importance(keys, window_queries, self.gqa_pool, self.kernel, self.pool)


@dataclass
class RKVPolicy(SnapKVPolicy):
    """R-KV: ``lam * importance - (1 - lam) * redundancy`` over the keys before the window: importance as
    :class:`SnapKVPolicy` (max-pooled), redundancy :func:`key_redundancy` of all keys (the window's
    included), sliced to the keys before the window. ``lam`` 0.1 as in the paper's runs (R-KV's own
    default is 0.07)."""
    lam: float = 0.1
    similarity_threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"R-KV: need 0 <= lam <= 1, got {self.lam}")

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        older = keys.shape[1] - window_queries.shape[1]
        importance = window_importance(keys, window_queries, self.gqa_pool, self.kernel, self.pool)
        redundancy = key_redundancy(keys, self.similarity_threshold)[:, :older]
        return self.lam * importance - (1.0 - self.lam) * redundancy


@dataclass
class H2OPolicy(EvictionPolicy):
    """H2O (heavy hitters): the attention each key received from every decode query so far (summed
    over the GQA group's query heads), accumulated by the caller and carried across compressions. The
    first compression waits for ``window`` decode steps (the prompt's own attention is not counted)."""
    needs_accumulated: ClassVar[bool] = True

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        if accumulated is None:
            raise ValueError("H2O needs the accumulated attention [kv_heads, length]")
        return accumulated[:, :accumulated.shape[1] - self.window]


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
