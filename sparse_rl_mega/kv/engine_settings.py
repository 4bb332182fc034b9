"""How the trainer hands KV-compression settings to SGLang's spawned processes: one JSON env var."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from collections.abc import Sequence
from typing import Any, Optional

from sparse_rl_mega.kv.base import EvictionPolicy
from sparse_rl_mega.kv.registry import NO_POLICY, policy_class

ENV_VAR = "SPARSE_RL_MEGA_KV"
# a request may carry its own settings in sampling_params["custom_params"][REQUEST_KEY] (a dict of the
# fields below) when the engine was started with allow_request_override; its own budget (no larger
# than the engine's) always
REQUEST_KEY = "sparse_rl_kv"


@dataclass
class EngineKVSettings:
    policy: str = "none"
    budget: int = 512
    sink: int = 4
    window: int = 8
    interval: int = 128
    selection: str = "per_layer"  # per_layer | per_head | shared (sparse_rl_mega.kv.base)
    shared_scores: str = "first_layer"  # shared selection: first_layer | layer_sum
    params: dict[str, Any] = field(default_factory=dict)  # the policy's own parameters (its class's fields: kernel, lam, ...)
    # newline trigger: also compress when past the budget and the token about to be decoded is one of these
    newline_token_ids: list[int] = field(default_factory=list)
    # let requests choose their own policy/budget (benchmarks and evaluation compare policies on one
    # engine); the engine then records decode queries and attention mass for every request, and
    # ``window`` is the largest window a request may ask for
    allow_request_override: bool = False
    # admit and keep running requests by their compressed size (budget + interval), not max_new_tokens
    compressed_admission: bool = True
    # transient memory for scoring the requests that reach the trigger at the same step (scored in chunks)
    scoring_workspace_bytes: int = 256 << 20
    # check, in every decode step, what the attention backend reads against the rows the patch kept
    # (sglang_patches/metadata_check.py: tests and debugging; a host copy of the step's indices)
    check_attention_metadata: bool = False

    def refusal(self, override: dict[str, Any]) -> Optional[str]:
        """Why this engine does not take a request's ``override`` (None: it does). Any override when
        the engine allows them; else only a budget no larger than the engine's (the automatic budget),
        which needs no more memory and records nothing more than the engine was started for."""
        if self.allow_request_override:
            return None
        if set(override) == {"budget"} and isinstance(override["budget"], int) and 0 < override["budget"] <= self.budget:
            return None
        return (f"this engine was started without allow_request_override: a request may only lower its budget "
                f"(at most {self.budget}), got {override}")

    def updated(self, override: dict[str, Any]) -> EngineKVSettings:
        engine_wide = ("allow_request_override", "compressed_admission", "check_attention_metadata")
        unknown = set(override) - {f for f in self.to_dict() if f not in engine_wide}
        if unknown:
            raise ValueError(f"unknown KV settings in a request: {sorted(unknown)}")
        merged = {**self.to_dict(), **override}
        if merged["window"] > self.window:
            raise ValueError(f"a request's window {merged['window']} exceeds the engine's {self.window}")
        return EngineKVSettings(**merged)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, kv_cfg: Any, newline_token_ids: Sequence[int] = (),
                    allow_request_override: bool = False) -> EngineKVSettings:
        """The engine's settings for ``rollout.kv_compression`` of a run config (a KVCompressionConfig):
        with an automatic budget, sized for its largest (each rollout's requests ask for the one in force)."""
        return cls(policy=kv_cfg.policy, budget=kv_cfg.largest_budget, sink=kv_cfg.sink, window=kv_cfg.window,
                   interval=kv_cfg.interval, selection=kv_cfg.selection, shared_scores=kv_cfg.shared_scores,
                   params=kv_cfg.policy_params(), newline_token_ids=list(newline_token_ids),
                   allow_request_override=allow_request_override)

    @property
    def enabled(self) -> bool:
        return self.policy != NO_POLICY

    @property
    def policy_class(self) -> Optional[type[EvictionPolicy]]:
        """The engine's own policy (None: dense); requests may choose others when overrides are allowed."""
        return policy_class(self.policy) if self.enabled else None

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> EngineKVSettings:
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else cls()


# side buffers of the KV patch beside SGLang's pool (docs/kv_compression.md, "Side buffers")
MASS_HEADROOM = 64  # H2O: a row's mass buffer grows in steps of this many positions beyond its length
DEFAULT_RUNNING_REQUESTS = 512  # GPU engines whose policy keeps side buffers, when max_running_requests is unset


def records_queries(settings: EngineKVSettings) -> bool:
    """The engine records decode queries: its policy scores with them (or adds up H2O's attention
    mass from them), or requests may choose any policy."""
    cls = settings.policy_class
    return settings.allow_request_override or (cls is not None and cls.records_queries())


def keeps_attention_mass(settings: EngineKVSettings) -> bool:
    cls = settings.policy_class
    return settings.allow_request_override or (cls is not None and cls.needs_accumulated)


def tp_split_problem(settings: EngineKVSettings, tp_size: int, kv_heads: int) -> Optional[str]:
    """Why an engine of ``tp_size`` TP ranks cannot run these settings on a model with ``kv_heads`` KV
    heads (None when it can): above the KV heads SGLang replicates each head and splits its query group
    over ranks, and a policy that records queries cannot score a head from part of its queries."""
    if tp_size <= kv_heads or not records_queries(settings):
        return None
    what = "per-request KV policies" if settings.allow_request_override else f"the KV policy {settings.policy!r}"
    return (f"{what} cannot score a KV head whose query heads are split over ranks; use an engine TP <= "
            f"{kv_heads} or a policy that selects by position (streaming)")


# SGLang 0.5.23 attention backends an engine with the KV patch may run (``rollout.attention_backend``),
# each read for what it builds from the request rows the patch compacts (one slot per token): the CPU's,
# and on NVIDIA GPUs SGLang's default for Llama/Qwen on Hopper (fa3), flashinfer and triton.
# Refused: those SGLang forces to pages (``srt/arg_groups/overrides.py``: trtllm_mha 64, fa4 128 on
# Blackwell, hpc_ops 64, intel_xpu 128, the MLA ones 32-64), where a compacted row breaks the paged
# allocator's last-page arithmetic (``mem_cache/allocation.py``), and those not read for eviction.
ATTENTION_BACKENDS = ("torch_native", "fa3", "flashinfer", "triton")


# a CPU engine runs these: the CPU's own, and triton's kernels under Triton's interpreter (for tests)
CPU_ATTENTION_BACKENDS = ("torch_native", "triton")


def attention_backend_problem(backend: Optional[str], on_cpu: bool = False) -> Optional[str]:
    """Why ``rollout.attention_backend`` ``backend`` (None: SGLang's default) cannot run the KV patch
    (``on_cpu``: on an engine without a GPU)."""
    if on_cpu and backend is not None and backend not in CPU_ATTENTION_BACKENDS and backend in ATTENTION_BACKENDS:
        return (f"{backend!r} needs an NVIDIA GPU: a CPU engine runs torch_native (the default) or triton (its "
                "kernels under Triton's interpreter, for tests: each kernel's programs one by one)")
    if backend is None or backend in ATTENTION_BACKENDS:
        return None
    return (f"{backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}: the KV patch compacts requests' KV "
            "rows slot by slot and needs one token per page, which SGLang does not keep for "
            f"{backend!r} (or which was not read for it)")


def resolved_engine_problem(resolved: dict[str, Any]) -> Optional[str]:
    """Why a scheduler as SGLang resolved it cannot run the KV patch (None: it can). ``resolved``:
    ``page_size`` (its KV allocator's), ``attention_backends`` (prefill, decode), ``sampling_backend``,
    ``overlap`` (the overlap scheduler runs), ``speculative`` (a speculative algorithm, or None)."""
    problems = []
    if resolved["page_size"] != 1:
        problems.append(f"its KV allocator has pages of {resolved['page_size']} tokens (needs 1: set "
                        f"rollout.attention_backend to one of {', '.join(ATTENTION_BACKENDS)})")
    for backend in dict.fromkeys(resolved["attention_backends"]):
        if attention_backend_problem(backend):
            problems.append(f"attention backend {backend!r} (rollout.attention_backend: one of "
                            f"{', '.join(ATTENTION_BACKENDS)})")
    if resolved["sampling_backend"] != "pytorch":
        problems.append(f"sampling backend {resolved['sampling_backend']!r} ignores request seeds (needs pytorch)")
    if resolved["overlap"]:
        problems.append("the overlap scheduler runs (the patch edits rows between steps)")
    if resolved["speculative"]:
        problems.append(f"speculative decoding ({resolved['speculative']})")
    return "; ".join(problems) or None


def cuda_graphs_allowed(kv: EngineKVSettings) -> tuple[bool, str]:
    """Whether a GPU engine may capture CUDA graphs with these KV settings, and why not.

    Policies that record queries do it from a Python hook on ``RadixAttention.forward`` indexed by
    CPU-side request state: a captured graph would run the hook once at capture with no requests and a
    replay would record nothing. Such engines run eagerly, as the paper's own code does
    (``--disable-cuda-graph``). Position-only policies (StreamingLLM) only compact rows between steps."""
    if records_queries(kv):
        what = "per-request policies record" if kv.allow_request_override else f"{kv.policy} records"
        return False, f"CUDA graphs off: {what} decode queries in a Python hook"
    if kv.check_attention_metadata:  # (a graph's replay writes captured buffers: no eager metadata to check)
        return False, "CUDA graphs off: check_attention_metadata reads each step's eager attention metadata"
    return True, "CUDA graphs on"


def ring_layers(settings: EngineKVSettings, layers: int) -> int:
    """Layers the query ring (and H2O's mass) hold: only the first when every request chooses one shared
    set from the first layer's scores."""
    first_only = (not settings.allow_request_override and settings.selection == "shared"
                  and settings.shared_scores == "first_layer")
    return 1 if first_only else layers


def scoring_bytes_per_request(settings: EngineKVSettings, *, layers: int, kv_heads: int, head_dim: int,
                              dtype_bytes: int, length: int) -> int:
    """Transient bytes to compress one request of ``length`` cached tokens (an upper estimate): what the
    policy's own scoring adds (:meth:`EvictionPolicy.scoring_bytes`, e.g. R-KV's similarities), the
    gathered keys with their float32 copies, and for per-layer / per-head sets every layer's gathered and
    kept K and V."""
    scored = 1 if settings.selection == "shared" and settings.shared_scores == "first_layer" else layers
    cls = settings.policy_class
    similarity = cls.scoring_bytes(scored_layers=scored, kv_heads=kv_heads, length=length) if cls else 0
    keys = scored * kv_heads * length * head_dim * (dtype_bytes + 8)
    copies = 0 if settings.selection == "shared" else 2 * layers * kv_heads * (length + settings.budget) * head_dim * dtype_bytes
    return similarity + keys + copies


def scoring_chunk(settings: EngineKVSettings, per_request_bytes: int) -> int:
    """How many requests of one length are scored together: within ``scoring_workspace_bytes`` (at least 1)."""
    return max(1, settings.scoring_workspace_bytes // max(per_request_bytes, 1))


def side_buffer_bytes(settings: EngineKVSettings, *, running_requests: int, layers: int, q_heads: int,
                      kv_heads: int, head_dim: int, dtype_bytes: int, prompt_tokens: int) -> dict[str, int]:
    """Bytes one engine TP rank holds beside its KV pool (``q_heads`` / ``kv_heads``: this rank's):

    * ``query_ring``: ``[running_requests + 1, ring layers, window, q_heads, head_dim]`` in the model's
      dtype (SGLang's request pool has one padding row);
    * ``h2o_mass``: float32 ``[ring layers, kv_heads, length + MASS_HEADROOM]`` per running request, its
      length at most ``prompt_tokens + budget + interval + 1``;
    * ``scoring``: the transient workspace of one compression batch (requests reaching the trigger at
      the same step are scored in chunks of :func:`scoring_chunk`), for requests of
      ``max(prompt_tokens, budget + interval) + 1`` tokens."""
    used = ring_layers(settings, layers)
    ring = mass = scoring = 0
    if records_queries(settings):
        ring = (running_requests + 1) * used * settings.window * q_heads * head_dim * dtype_bytes
        length = max(prompt_tokens, settings.budget + settings.interval) + 1
        per_request = scoring_bytes_per_request(settings, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                                dtype_bytes=dtype_bytes, length=length)
        scoring = min(running_requests, scoring_chunk(settings, per_request)) * per_request
    if keeps_attention_mass(settings):
        longest = prompt_tokens + settings.budget + settings.interval + 1
        mass = running_requests * used * kv_heads * (longest + MASS_HEADROOM) * 4
    return {"query_ring": ring, "h2o_mass": mass, "scoring": scoring}


def compressed_bound(settings: EngineKVSettings) -> int:
    """The most slots a compressed request ever owns past its prompt (admission and the planner)."""
    return settings.budget + settings.interval + 1
