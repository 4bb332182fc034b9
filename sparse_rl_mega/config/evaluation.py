"""``eval``: which KV settings the held-out set is decoded under (``"dense,rollout,snapkv:64"``), parsed
and checked against the rollout's KV section."""
from __future__ import annotations

from typing import Any, Optional

from sparse_rl_mega.config.errors import ConfigError, require
from sparse_rl_mega.config.run import RunConfig
from sparse_rl_mega.kv.base import PolicyError
from sparse_rl_mega.kv.registry import policy_names


def request_kv(kv: Any, policy: str, budget: int) -> dict[str, Any]:
    """The per-request KV settings of ``policy`` at ``budget`` with every other field of ``kv`` (a
    KVCompressionConfig: sink, window, interval, selection, shared scores and the policy's parameters,
    e.g. R-KV's kernel and lambda), whatever ``kv``'s own policy is (a dense run's section still says
    how its compressed evaluation scores)."""
    return {"policy": policy, "budget": budget, "sink": kv.sink, "window": kv.window, "interval": kv.interval,
            "selection": kv.selection, "shared_scores": kv.shared_scores, "params": kv.policy_params(policy)}


AUTO = {"budget": "auto"}  # parse_kv_variants: the rollout's automatic budget, resolved when evaluated


def parse_kv_variants(spec: str, rollout_kv: Any = None) -> list[tuple[str, Optional[dict[str, Any]]]]:
    """``"dense,rollout,snapkv:64"`` -> ``[(label, per-request KV override or None), ...]``.

    ``dense`` / ``none``: no compression; ``POLICY:BUDGET``: that policy at that budget with every
    other field of ``rollout_kv`` (:func:`request_kv`; without ``rollout_kv``, the engine's other
    settings); ``rollout``: the engine's own settings (``rollout_kv``, a KVCompressionConfig, names the
    label; the override is None; with an automatic budget the label is ``POLICY:auto`` and the trainer
    gives each evaluation the budget in force: :data:`AUTO`). A setting named twice ('rollout' and the same explicit setting) is
    evaluated once. Raises ValueError naming the bad item."""
    out: list[tuple[str, Optional[dict[str, Any]]]] = []
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if len(set(items)) != len(items):
        raise ValueError(f"KV settings repeat: {items}")
    for item in items:
        if item in ("none", "dense"):
            out.append(("dense", {"policy": "none"}))
        elif item == "rollout":
            if rollout_kv is None:
                raise ValueError("'rollout' names the training rollout's KV setting; there is none here")
            if rollout_kv.policy != "none" and rollout_kv.auto_budget is not None:
                out.append((f"{rollout_kv.policy}:auto", AUTO))
                continue
            label = "dense" if rollout_kv.policy == "none" else f"{rollout_kv.policy}:{rollout_kv.budget}"
            out.append((label, None))
        else:
            name, _, budget = item.partition(":")
            if name not in policy_names() or not budget.isdigit() or int(budget) <= 0:
                raise ValueError(f"{item!r}: expected dense, rollout or POLICY:BUDGET with POLICY in "
                                 f"{sorted(policy_names())} and BUDGET a positive integer")
            out.append((item, {"policy": name, "budget": int(budget)} if rollout_kv is None
                        else request_kv(rollout_kv, name, int(budget))))
    if not out:
        raise ValueError("no KV setting given")
    # 'rollout' may name a setting also listed explicitly (dense rollouts and 'dense'): evaluate it once
    unique: dict[str, Optional[dict[str, Any]]] = {}
    for label, override in out:
        unique.setdefault(label, override)
    return list(unique.items())


def needs_request_override(variants: list[tuple[str, Optional[dict[str, Any]]]]) -> bool:
    """Whether evaluating ``variants`` (:func:`parse_kv_variants`) needs an engine that accepts
    per-request KV settings (any setting other than the rollout's own)."""
    return any(override is not None and override is not AUTO for _, override in variants)


def validate_eval(cfg: RunConfig, source: str) -> None:
    e = cfg.eval
    if e.path is None:
        return
    require(e.limit is None or e.limit > 0, source, "eval.limit", f"must be > 0 or null, got {e.limit}")
    require(e.interval >= 0, source, "eval.interval", f"must be >= 0 (0: before and after only), got {e.interval}")
    require(e.n_samples > 0, source, "eval.n_samples", f"must be > 0, got {e.n_samples}")
    require(e.temperature >= 0, source, "eval.temperature", f"must be >= 0, got {e.temperature}")
    require(0.0 < e.top_p <= 1.0, source, "eval.top_p", f"must be in (0, 1], got {e.top_p}")
    require(e.temperature > 0 or e.n_samples == 1, source, "eval.n_samples",
             "greedy decoding (eval.temperature: 0) gives one answer per problem: set n_samples: 1")
    require(e.max_new_tokens is None or e.max_new_tokens > 0, source, "eval.max_new_tokens",
             f"must be > 0 or null, got {e.max_new_tokens}")
    positions = cfg.model.arch.max_position_embeddings
    require(e.max_new_tokens is None or e.max_new_tokens <= positions - 3, source, "eval.max_new_tokens",
             f"{e.max_new_tokens} does not fit the model's {positions} positions (model.arch.max_position_embeddings): "
             f"SGLang generates at most {positions - 3}, after a one-token prompt")
    try:
        variants = parse_kv_variants(e.kv, cfg.rollout.kv_compression)
    except ValueError as exc:
        raise ConfigError(f"{source}: eval.kv: {exc}") from None
    kv = cfg.rollout.kv_compression
    for label, override in variants:
        if override and override is not AUTO and override["policy"] != "none":  # (AUTO: within auto_budget)
            try:
                kv.build_policy(override["policy"]).check_budget(override["budget"])
            except PolicyError as exc:
                raise ConfigError(f"{source}: eval.kv: {label}: {exc} (its other settings: rollout.kv_compression)") from None
