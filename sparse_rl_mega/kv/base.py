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

Adding a policy: a subclass of :class:`EvictionPolicy` in a file of its own (``streaming.py``, ``snapkv.py``,
``rkv.py``, ``h2o.py`` here) whose own dataclass fields are its parameters (``kv_compression.params`` in a
run config; ``metadata={"help": ...}`` documents them for the CLIs), with its capabilities as class
attributes (:attr:`~EvictionPolicy.queries_needed`, :attr:`~EvictionPolicy.needs_accumulated`,
:attr:`~EvictionPolicy.position_only`, :meth:`~EvictionPolicy.scoring_bytes`), registered under a name
(``registry.py``).

The policies' declarations (fields, checks, capabilities) import no torch: the config, ``--plan`` and the
tools read them without it. The tensor work imports torch where it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Optional
from collections.abc import Callable

if TYPE_CHECKING:
    import torch

SELECTIONS = ("per_layer", "per_head", "shared")

SHARED_SCORES = ("first_layer", "layer_sum")

GQA_POOLS = ("max", "mean")

POOLS = ("max", "avg")



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
        import torch  # (here, not at the top: the config reads the policies' declarations without torch)

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
        import torch  # (here, not at the top: the config reads the policies' declarations without torch)

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
        if keys is None:
            raise ValueError(f"{type(self).__name__} scores the keys: keys [kv_heads, length, head_dim] needed")
        kept = self.select_layers(keys[None, None], None if window_queries is None else window_queries[None, None],
                                  budget, None if accumulated is None else accumulated[None, None])
        return kept[0] if self.selection == "shared" else kept[0, 0]
