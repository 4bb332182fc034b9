"""The KV settings of ``tools/evaluate.py``'s command line: ``none | POLICY:BUDGET | rollout`` settings
(config/evaluation.py's grammar) completed from a run config's ``rollout.kv_compression`` or the
defaults, each policy's own parameters as flags, the sink and window derived from a budget, every
setting checked as the engine will check it."""
from __future__ import annotations

import dataclasses

from sparse_rl_mega.config import KVCompressionConfig, load_config_or_exit
from sparse_rl_mega.config.evaluation import AUTO, parse_kv_variants
from sparse_rl_mega.kv.engine_settings import EngineKVSettings
from sparse_rl_mega.kv.registry import policy_class, policy_names

KV_FIELDS = ("interval", "window", "sink", "selection", "shared_scores", "trigger")
BUDGET_FIELDS = ("sink", "window")  # derived from each setting's budget without --config or their flags


class UsageError(ValueError):
    """A problem with the command line: printed as one ``evaluate.py: error:`` line, exit status 2."""


def default_kv():
    """The KV fields without --config: the run config's defaults, compressing every 16 decode steps
    (sink and window are then derived from each budget: :func:`budget_defaults`)."""
    return KVCompressionConfig(interval=16)


def budget_defaults(budget: int) -> dict:
    """``{"sink", "window"}`` of a ``POLICY:BUDGET`` setting when neither --config nor a flag gives them:
    the defaults (4 and 8) from budget 32 on, smaller below. Every budget >= 2 then runs, as the policies
    need window >= 1 and budget > sink + window: window = min(8, B // 4) but at least 1, sink =
    min(4, B // 8), so sink + window <= 3B/8 (1 for B < 4)."""
    base = default_kv()
    return {"window": max(1, min(base.window, budget // 4)), "sink": min(base.sink, budget // 8)}


def policy_param_flags() -> dict[str, dict]:
    """argparse keywords of a flag for each parameter of the registered KV policies (their dataclass
    fields, documented by their ``help`` and ``choices`` metadata), named after the policies that take it."""
    import dataclasses
    import typing

    flags: dict[str, dict] = {}
    takers: dict[str, list[str]] = {}
    for name in policy_names():
        cls = policy_class(name)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name not in cls.param_names():
                continue
            takers.setdefault(field.name, []).append(name)
            flags.setdefault(field.name, {"type": hints[field.name], "choices": field.metadata.get("choices"),
                                          "help": field.metadata.get("help", ""), "default_value": field.default})
    for key, flag in flags.items():
        flag["help"] = f"{'/'.join(takers[key])}: {flag['help']} (default {flag.pop('default_value')})".replace("%", "%%")
    return flags


def kv_base(args):
    """The KVCompressionConfig every ``POLICY:BUDGET`` setting takes its other fields from."""

    base = load_config_or_exit(args.config).rollout.kv_compression if args.config else default_kv()
    params = {f: getattr(args, f) for f in policy_param_flags() if getattr(args, f) is not None}
    return dataclasses.replace(base, params={**base.params, **params},
                               **{f: getattr(args, f) for f in KV_FIELDS if getattr(args, f) is not None})


def derived_fields(args) -> tuple[str, ...]:
    """The fields of BUDGET_FIELDS each ``POLICY:BUDGET`` setting derives from its budget: those without
    a flag, and none with --config (a run's settings are taken as they are)."""
    return () if args.config else tuple(f for f in BUDGET_FIELDS if getattr(args, f) is None)


def parse_kv(spec: str, base=None, derived=()) -> list[tuple[str, dict]]:
    """``none,rkv:64`` -> ``[("dense", {"policy": "none"}), ("rkv:64", {"policy": "rkv", "budget": 64, ...})]``
    (each compressed setting with every other field of ``base``, a KVCompressionConfig, except the
    ``derived`` fields, which follow its budget: :func:`budget_defaults`), checked as the engine will
    check it. Raises UsageError naming the bad setting."""
    from sparse_rl_mega.rollout.engine_args import check_request_kv

    base = base or default_kv()
    try:
        variants = parse_kv_variants(spec, base)
    except ValueError as exc:
        raise UsageError(f"--kv: {exc}") from None
    engine = EngineKVSettings.from_config(base, allow_request_override=True)  # (as main starts it)
    try:  # the engine's own setting, which its plugin checks at start (--config's budget with the flags)
        check_request_kv(engine, None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"the engine's KV setting ({base.policy}:{base.budget}, the --config budget with the KV "
                         f"flags): {exc}{kv_fix(exc, dataclasses.asdict(base))}") from None
    for label, override in variants:
        if override is AUTO:
            raise UsageError(f"--kv rollout: the config's budget is automatic (rollout.kv_compression.auto_budget "
                             f"[{base.auto_budget.min}, {base.auto_budget.max}]): name one, e.g. "
                             f"{base.policy}:{base.auto_budget.max}")
        if override is not None and "budget" in override:
            override.update({f: v for f, v in budget_defaults(override["budget"]).items() if f in derived})
        try:
            check_request_kv(engine, override)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"--kv {label}: {exc}{kv_fix(exc, override or dataclasses.asdict(base))}") from None
    return variants


def kv_fix(refusal: Exception, setting: dict) -> str:
    """What to change in a KV ``setting`` (a request's fields) that the engine refused."""
    if getattr(refusal, "key", None) == "budget":  # (kv.base.PolicyError: the budget rule)
        return (f" (sink {setting['sink']}, window {setting['window']}): use a larger budget or a smaller "
                "--sink / --window")
    return ": fix that KV flag (or its --config field)"
