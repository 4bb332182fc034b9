"""``rollout``: engines, sampling, supervision, overlap, and its KV compression section (checked by the
policy classes themselves)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from sparse_rl_mega.config.algorithm import LOG_RHO_QUANTILES
from sparse_rl_mega.config.errors import ConfigError, require
from sparse_rl_mega.kv.base import EvictionPolicy, PolicyError
from sparse_rl_mega.kv.engine_settings import EngineKVSettings, tp_split_problem
from sparse_rl_mega.kv.registry import NO_POLICY, build_policy, policy_class, policy_names, resolve_params


@dataclass
class AutoBudgetConfig:
    """``rollout.kv_compression.auto_budget``: the budget of each rollout set from the mismatch the last
    one measured (sparse_rl_mega/kv/auto_budget.py, docs/algorithm.md "The automatic budget"). The
    section's ``budget`` is where it starts; engines, ``--plan``, admission and the side buffers are
    sized for ``max``."""
    min: Optional[int] = None  # the smallest budget it may set
    max: Optional[int] = None
    # the target: the quantile-percent quantile of rho = pi_old / pi_sparse over response tokens stays
    # >= min_rho (one of the measured quantiles, algo/correction.py LOG_RHO_QUANTILES below the median)
    quantile: float = 5.0
    min_rho: float = 0.5  # that quantile's bound
    # the steps: default a third of the range up and a quarter of that down
    increase: Optional[int] = None  # tokens up after a violation (default above)
    decrease: Optional[int] = None  # tokens down after a rollout within the target (default above)

    @property
    def step_up(self) -> int:
        if self.increase is not None:
            return self.increase
        assert self.min is not None and self.max is not None, "set: validate_auto_budget requires both"
        return max(1, math.ceil((self.max - self.min) / 3))

    @property
    def step_down(self) -> int:
        return self.decrease if self.decrease is not None else max(1, math.ceil(self.step_up / 4))


@dataclass
class KVCompressionConfig:
    """Per-request KV eviction during decode (prefill is never compressed); docs/kv_compression.md.

    Once a request's KV length reaches ``budget + interval`` it is compressed back to ``budget``
    tokens: ``sink`` first tokens + the policy's choice among the older tokens + the ``window`` most
    recent. ``policy`` names a registered policy (``sparse_rl_mega/kv/registry.py``: ``streaming``,
    ``snapkv``, ``rkv``, ``h2o``, or a package's through an entry point) and ``params`` its own
    parameters (e.g. ``rkv``: ``{kernel: 7, lam: 0.1}``; the policy class lists them and checks them).
    The paper's runs: ``rkv``, ``sink: 0``, ``selection: shared``."""
    policy: str = "none"          # none: dense decoding
    budget: int = 512
    sink: int = 4                 # first tokens always kept (StreamingLLM's sinks; the published R-KV/SnapKV: 0)
    window: int = 8
    interval: int = 128  # compress when a request holds budget + interval tokens (every interval decoded tokens)
    # scoring policies: one kept set per layer (KV heads' scores summed), per KV head (R-KV's own code),
    # or one set for every layer of a request (the paper's release; the engine then copies no K/V)
    selection: Literal["per_layer", "per_head", "shared"] = "per_layer"
    shared_scores: Literal["first_layer", "layer_sum"] = "first_layer"  # shared: scores of the first layer (release) or all
    # "newline": also compress whenever past the budget and the token about to be decoded ends a line
    trigger: Literal["length", "newline"] = "length"
    # the policy's own parameters; a dense run's (or another policy's) evaluation under compression takes
    # those its policy has
    params: dict[str, Any] = field(default_factory=dict)
    # set: the budget follows the measured mismatch within [min, max], starting at ``budget``
    auto_budget: Optional[AutoBudgetConfig] = None

    @property
    def largest_budget(self) -> int:
        """The most a rollout's request may keep: what engines and memory are sized for."""
        auto = self.auto_budget
        return auto.max if auto is not None and auto.max is not None else self.budget

    def policy_params(self, policy: Optional[str] = None) -> dict[str, Any]:
        """Every parameter of ``policy`` (default: this section's): its defaults, overridden by those of
        ``params`` it takes (each must be some registered policy's: ``validate``)."""
        name = policy or self.policy
        if name == NO_POLICY:
            return {}
        taken = policy_class(name).param_names()
        return resolve_params(name, {key: value for key, value in self.params.items() if key in taken})

    def build_policy(self, policy: Optional[str] = None) -> EvictionPolicy:
        """The policy object of ``policy`` (default: this section's) with these settings; a bad setting
        raises ``PolicyError`` naming its key."""
        return build_policy(policy or self.policy, sink=self.sink, window=self.window, selection=self.selection,
                            shared_scores=self.shared_scores, **self.policy_params(policy))


@dataclass
class RolloutConfig:
    num_engines: int = 1  # SGLang engines serving the rollouts
    engine_tensor_parallel_size: int = 1  # TP of each engine (its GPUs, or CPU processes)
    # colocated: engines share the learner's devices and sleep while it trains; separate: their own
    placement: Literal["colocated", "separate"] = "colocated"
    n_samples_per_prompt: int = 8  # responses per prompt (the GRPO group)
    max_new_tokens: int = 1024  # the longest response
    # the sampling distribution: softmax(logits / temperature), truncated to the top_k most likely tokens
    # (-1: off) and to the smallest set of them holding top_p of the mass, renormalised. The learner's
    # passes reproduce it exactly (docs/algorithm.md, "The behaviour policy"); min_p is refused (> 0):
    # SGLang 0.5.23's seeded sampler cannot draw it
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling (1: off); the learner reproduces the truncation
    top_k: int = -1  # top-k sampling (-1: off); the learner reproduces the truncation
    min_p: float = 0.0  # must stay 0: the learner cannot reproduce min-p (refused)
    # the engine's KV pool in tokens; None: SGLang's sizing from mem_fraction_static
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.8  # SGLang's share of GPU memory for weights and KV pool
    # requests an engine decodes at once; None: SGLang's choice (GPU engines with a scoring policy: 512)
    max_running_requests: Optional[int] = None
    attention_backend: Optional[str] = None  # None: torch_native on CPU, SGLang's default on GPU
    kv_compression: KVCompressionConfig = field(default_factory=KVCompressionConfig)
    # supervision (sparse_rl_mega/rollout/supervisor.py): an engine call with no answer from the engine
    # for engine_timeout_s (no generated output, no reply to a weight bucket) fails, as does one whose
    # engine processes died; the engine is then restarted, at most max_engine_restarts times per job
    startup_timeout_s: float = 1800.0  # an engine's start (a 70B engine loads for minutes)
    engine_timeout_s: float = 600.0  # an engine call with no answer for this long fails the engine (then restarted)
    max_engine_restarts: int = 3  # restarts of failed engines before the run stops
    # overlapped rollouts (sparse_rl_mega/rollout/overlap.py): 0 = generate, then train, then push; K >= 1:
    # the engines generate the next iteration's samples while the learner trains, and no sample is trained
    # on with weights more than K versions (iterations) older than the learner's
    max_staleness: int = 0
    # partial rollouts (docs/algorithm.md "Partial rollouts"; needs max_staleness >= 1): at a weight push
    # the engines pause the requests in flight instead of finishing them first, and start the batches the
    # bound allows at once; the paused requests resume under the new weights, each token carrying the
    # version that sampled it. "stale": their KV, compressed as it is, kept; "reprefill": prompt and output
    # so far prefilled again under the new weights (compression starts anew); "none": pushes wait for the
    # batch in flight (every sample one version)
    partial: Literal["none", "stale", "reprefill"] = "none"

    @property
    def truncates(self) -> bool:
        """Whether sampling truncates the distribution (top-k or top-p): the engines then report each
        token's support and the learner renormalises over it."""
        return self.top_p < 1.0 or self.top_k > 0


def policy_param_names() -> set[str]:
    return {name for policy in policy_names() for name in policy_class(policy).param_names()}


def validate_kv(cfg: Any, source: str) -> None:  # (cfg: a RunConfig, whose module imports this one)
    """``rollout.kv_compression``: its policy and parameters, checked by the policy class itself. Each
    of ``params`` must be a parameter of some registered policy; the policy takes those it has (one
    section serves a comparison of policies by ``--set rollout.kv_compression.policy=...``, and a dense
    run's compressed evaluation)."""
    kv, r, a = cfg.rollout.kv_compression, cfg.rollout, cfg.model.arch
    key = "rollout.kv_compression"
    known = policy_param_names()
    for name in kv.params:
        require(name in known, source, f"{key}.params.{name}",
                f"no registered KV policy takes it; parameters: {', '.join(sorted(known))}")
    if kv.policy == NO_POLICY:
        return
    try:
        kv.build_policy().check_budget(kv.budget)
    except PolicyError as exc:
        raise ConfigError(f"{source}: {key}.{exc.key}: {exc}") from None
    require(kv.interval > 0, source, f"{key}.interval", f"must be > 0, got {kv.interval}")
    if kv.auto_budget is not None:
        validate_auto_budget(kv, source)
    problem = tp_split_problem(EngineKVSettings.from_config(kv), r.engine_tensor_parallel_size, a.num_query_groups)
    require(problem is None, source, "rollout.engine_tensor_parallel_size",
            f"{r.engine_tensor_parallel_size} exceeds model.arch.num_query_groups={a.num_query_groups}: {problem}")


def validate_auto_budget(kv: KVCompressionConfig, source: str) -> None:
    auto, key = kv.auto_budget, "rollout.kv_compression.auto_budget"
    assert auto is not None  # (validate_kv calls this when the section is set)
    for bound in ("min", "max"):
        require(getattr(auto, bound) is not None, source, f"{key}.{bound}",
                "required: the automatic budget stays within [min, max]")
    assert auto.min is not None and auto.max is not None  # (refused above otherwise)
    try:
        kv.build_policy().check_budget(auto.min)
    except PolicyError as exc:
        raise ConfigError(f"{source}: {key}.min: {exc}") from None
    require(auto.min <= auto.max, source, f"{key}.max", f"must be >= min = {auto.min}, got {auto.max}")
    require(auto.min <= kv.budget <= auto.max, source, "rollout.kv_compression.budget",
            f"{kv.budget} is where the automatic budget starts: it must lie in auto_budget [{auto.min}, {auto.max}]")
    tails = [q for q in LOG_RHO_QUANTILES if q < 50]
    require(auto.quantile in tails, source, f"{key}.quantile",
            f"must be one of the measured lower quantiles of log rho {tails} (percent), got {auto.quantile:g}")
    require(0 < auto.min_rho < 1, source, f"{key}.min_rho", f"must be in (0, 1), got {auto.min_rho}")
    for step in ("increase", "decrease"):
        value = getattr(auto, step)
        require(value is None or value >= 1, source, f"{key}.{step}", f"must be >= 1 token, got {value}")
