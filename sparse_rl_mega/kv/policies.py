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

Adding a policy: a subclass of :class:`EvictionPolicy` whose own dataclass fields are its parameters
(``kv_compression.params`` in a run config; ``metadata={"help": ...}`` documents them for the CLIs),
with its capabilities as class attributes (:attr:`~EvictionPolicy.queries_needed`,
:attr:`~EvictionPolicy.needs_accumulated`, :attr:`~EvictionPolicy.position_only`,
:meth:`~EvictionPolicy.scoring_bytes`), registered under a name: :data:`POLICIES` for those here, or a
``sparse_rl_mega.kv_policies`` entry point (``name = package.module:Class``) for a policy in another
package, which every process (the trainer, tools, SGLang's schedulers) loads on its first lookup.

When to compress (:func:`should_compress`): once the cached length reaches ``budget + interval``, the
request is compressed back to ``budget`` tokens (the cache swings between B and B + interval); with
the newline trigger also whenever it is past the budget and the token about to be decoded ends a line.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Callable, ClassVar, NamedTuple, Optional

import torch
import torch.nn.functional as F

SELECTIONS = ("per_layer", "per_head", "shared")
SHARED_SCORES = ("first_layer", "layer_sum")
GQA_POOLS = ("max", "mean")
POOLS = ("max", "avg")
ENTRY_POINT_GROUP = "sparse_rl_mega.kv_policies"  # a package's policies: ``name = package.module:Class``


class PolicyError(ValueError):
    """A bad policy setting. ``key`` names it: a field of the policy (``sink``, ``window``, ``selection``,
    ``shared_scores``, ``budget``) or ``params.NAME`` for one of the policy's own parameters, so that the
    config can name ``rollout.kv_compression.<key>``."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key

    __str__ = Exception.__str__  # (not KeyError's quoting, for UnknownPolicyError)


class UnknownPolicyError(PolicyError, KeyError):
    """A policy name nothing registered (a KeyError too: a lookup that failed)."""


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
    Subclasses implement :meth:`score`; their own fields are their parameters (``params``)."""
    sink: int = 4
    window: int = 8
    selection: str = "per_layer"
    shared_scores: str = "first_layer"
    # capabilities, read by the engine patch, its settings and the planner
    position_only: ClassVar[bool] = False       # the choice depends on positions only (same for all layers)
    queries_needed: ClassVar[bool] = False      # scores with the last ``window`` decode queries
    needs_accumulated: ClassVar[bool] = False   # scores with accumulated decode attention (H2O)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.sink < 0:
            raise PolicyError("sink", f"{name}: must be >= 0, got {self.sink}")
        if self.window <= 0:
            raise PolicyError("window", f"{name}: must be > 0, got {self.window}")
        if self.selection not in SELECTIONS:
            raise PolicyError("selection", f"{name}: must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.position_only and self.selection == "per_head":
            raise PolicyError("selection", f"{name} selects by position, the same tokens for every head and layer "
                                           "(per_head is for scoring policies)")
        if self.shared_scores not in SHARED_SCORES:
            raise PolicyError("shared_scores", f"{name}: must be one of {', '.join(SHARED_SCORES)}, "
                                               f"got {self.shared_scores!r}")

    @classmethod
    def param_names(cls) -> tuple[str, ...]:
        """The policy's own parameters: its dataclass fields beyond the base class's."""
        base = {f.name for f in fields(EvictionPolicy)}
        return tuple(f.name for f in fields(cls) if f.name not in base)

    @classmethod
    def records_queries(cls) -> bool:
        """Whether the engine records each decode step's queries for this policy (it scores with them,
        or H2O adds up the attention they paid), and so whether a request's first compression waits for
        ``window`` decode steps: without them it would choose on nothing (all-zero scores keep the
        oldest tokens). Such a policy runs a Python hook at every decode step: no CUDA graphs, and an
        engine TP above the model's KV heads is refused (a KV head's query group would be split)."""
        return cls.queries_needed or cls.needs_accumulated

    @classmethod
    def scoring_bytes(cls, *, scored_layers: int, kv_heads: int, length: int) -> int:
        """Transient bytes the policy's own scoring adds for one request of ``length`` cached tokens,
        beyond the gathered keys (the engine counts those): an upper estimate, for the side buffers."""
        return 0

    def check_budget(self, budget: int) -> None:
        """The one rule between the budget and the policy: room for the sink, the window and one more."""
        if budget <= self.sink + self.window:
            raise PolicyError("budget", f"budget {budget} must exceed sink + window = {self.sink + self.window}")

    @property
    def min_decode_queries(self) -> int:
        return self.window if self.records_queries() else 0

    @property
    def shared(self) -> bool:
        """One kept set for every layer of a request (the engine compacts the row, copies nothing)."""
        return self.position_only or self.selection == "shared"

    def scored_layers(self, layers: int) -> int:
        """How many layers (the first ones) the choice reads: 1 for ``shared`` from the first layer."""
        return 1 if self.selection == "shared" and self.shared_scores == "first_layer" else layers

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
    kernel: int = field(default=7, metadata={"help": "pooling kernel along the sequence (odd)"})
    pool: str = field(default="max", metadata={"help": "pooling mode (release: max; original SnapKV: avg)",
                                               "choices": POOLS})
    gqa_pool: str = field(default="max", metadata={"help": "over a KV head's query heads, on the logits",
                                                   "choices": GQA_POOLS})
    queries_needed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise PolicyError("params.kernel", f"{name}: kernel must be odd and >= 1, got {self.kernel}")
        for key, allowed in (("pool", POOLS), ("gqa_pool", GQA_POOLS)):
            if getattr(self, key) not in allowed:
                raise PolicyError(f"params.{key}", f"{name}: {key} must be one of {', '.join(allowed)}, "
                                                   f"got {getattr(self, key)!r}")

    def score(self, keys, window_queries, accumulated=None) -> torch.Tensor:
        return window_importance(keys, window_queries, self.gqa_pool, self.kernel, self.pool)


@dataclass
class RKVPolicy(SnapKVPolicy):
    """R-KV: ``lam * importance - (1 - lam) * redundancy`` over the keys before the window: importance as
    :class:`SnapKVPolicy` (max-pooled), redundancy :func:`key_redundancy` of all keys (the window's
    included), sliced to the keys before the window. ``lam`` 0.1 as in the paper's runs (R-KV's own
    default is 0.07)."""
    lam: float = field(default=0.1, metadata={"help": "importance weight (1 - lam weighs redundancy; R-KV's own "
                                                      "default 0.07)"})
    similarity_threshold: float = field(default=0.5, metadata={"help": "cosine similarity above which keys are "
                                                                       "near-duplicates"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lam <= 1.0:
            raise PolicyError("params.lam", f"R-KV: need 0 <= lam <= 1, got {self.lam}")

    @classmethod
    def scoring_bytes(cls, *, scored_layers: int, kv_heads: int, length: int) -> int:
        # the key similarities: float32 and two one-byte masks per key pair and head of every scored layer
        return scored_layers * kv_heads * length * length * 6

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
}  # the registry: these, then what register_policy and the entry points add
NO_POLICY = "none"  # a config's policy for dense decoding
_entry_points_loaded = False


def register_policy(name: str, cls: type[EvictionPolicy]) -> None:
    """Make ``cls`` available to configs, tools and the engine patch under ``name`` (in this process; a
    ``sparse_rl_mega.kv_policies`` entry point registers it in every process)."""
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise TypeError(f"KV policy {name!r}: {cls!r} is not a subclass of EvictionPolicy")
    if not name.isidentifier() or name == NO_POLICY:
        raise ValueError(f"KV policy name {name!r}: expected an identifier other than {NO_POLICY!r} "
                         "(it is written POLICY:BUDGET in eval.kv)")
    if POLICIES.get(name, cls) is not cls:
        raise ValueError(f"KV policy {name!r} is already registered as {POLICIES[name].__qualname__}")
    POLICIES[name] = cls


def load_entry_points() -> None:
    """Register the policies of installed packages (entry point group ``sparse_rl_mega.kv_policies``),
    once per process; the lookups below call it, so every process sees the same policies."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_policy(point.name, point.load())
        except Exception as exc:  # one line naming the entry point, whatever the plugin raised
            raise RuntimeError(f"KV policy entry point {point.name} = {point.value} ({ENTRY_POINT_GROUP}): "
                               f"{type(exc).__name__}: {exc}") from None


def policy_names() -> list[str]:
    """Every registered policy, those of this module first."""
    load_entry_points()
    return list(POLICIES)


def policy_class(name: str) -> type[EvictionPolicy]:
    load_entry_points()
    if name not in POLICIES:
        raise UnknownPolicyError("policy", f"unknown KV eviction policy {name!r}; expected one of "
                                    f"{', '.join([NO_POLICY, *POLICIES])}")
    return POLICIES[name]


def resolve_params(name: str, params: dict) -> dict:
    """Every parameter of policy ``name``: its defaults, overridden by those ``params`` names (checked:
    a parameter it does not take, or a value of the wrong type, raises PolicyError naming it)."""
    cls = policy_class(name)
    hints = typing.get_type_hints(cls)
    own = {f.name: f.default for f in fields(cls) if f.name in cls.param_names()}
    for key, value in params.items():
        if key not in own:
            taken = ", ".join(own) or "none"
            raise PolicyError(f"params.{key}", f"{cls.__name__} ({name}) takes no parameter {key!r}; its "
                                               f"parameters: {taken}")
        expected = hints[key]
        ok = (isinstance(value, expected) and not isinstance(value, bool)) or \
            (expected is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise PolicyError(f"params.{key}", f"{cls.__name__} ({name}): {key} = {value!r}: expected "
                                               f"{expected.__name__}, got {type(value).__name__}")
        own[key] = float(value) if expected is float else value
    return own


def build_policy(name: str, sink: int, window: int, **settings) -> EvictionPolicy:
    """Policy ``name`` with the base fields (``selection``, ``shared_scores``) and its own parameters
    in ``settings``; a bad one raises PolicyError naming it."""
    base = {key: settings.pop(key) for key in ("selection", "shared_scores") if key in settings}
    return policy_class(name)(sink=sink, window=window, **base, **resolve_params(name, settings))


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


class CompressionReplay(NamedTuple):
    compressions: int
    evicted_tokens: int
    peak_tokens: int  # the most KV one decode step attended over (after its compression, with the step's token)


def replay_compression(prompt_len: int, response_len: int, budget: int, interval: int,
                       queries_needed: int = 0, newline_at: Optional[list[bool]] = None) -> CompressionReplay:
    """What compression did to one request, from lengths alone.

    Replays the trigger of :func:`should_compress` over the request's decode steps (the first response
    token comes from the prefill; decode step ``t`` feeds response token ``t - 1``); ``newline_at[t]``
    says whether response token ``t`` ends a line (newline trigger). The engine follows the same rule,
    except when it has to postpone a compression for lack of free slots. A request that is never
    compressed peaks at ``prompt_len + response_len - 1`` (its dense KV; the last token is not fed)."""
    cached, compressions, evicted, peak = prompt_len, 0, 0, prompt_len
    for step in range(1, response_len):
        at_newline = bool(newline_at[step - 1]) if newline_at is not None else False
        if should_compress(cached, budget, interval, step - 1, queries_needed, at_newline):
            evicted += cached - budget
            cached = budget
            compressions += 1
        cached += 1
        peak = max(peak, cached)
    return CompressionReplay(compressions, evicted, peak)


def compression_schedule(prompt_len: int, response_len: int, budget: int, interval: int,
                         queries_needed: int = 0, newline_at: Optional[list[bool]] = None) -> tuple[int, int]:
    """``(compressions, evicted_tokens)`` of one request (:func:`replay_compression`)."""
    return tuple(replay_compression(prompt_len, response_len, budget, interval, queries_needed, newline_at)[:2])
