"""The policies by name: those of this package, those registered in this process, and those of installed
packages through the ``sparse_rl_mega.kv_policies`` entry point group (``name = package.module:Class``),
which every process (the trainer, tools, SGLang's schedulers) loads on its first lookup. A policy is
built from its name, the base fields and its own checked parameters."""
from __future__ import annotations

import typing
from typing import Any
from dataclasses import fields
from importlib.metadata import entry_points

from sparse_rl_mega.kv.base import EvictionPolicy, PolicyError, UnknownPolicyError
from sparse_rl_mega.kv.h2o import H2OPolicy
from sparse_rl_mega.kv.rkv import RKVPolicy
from sparse_rl_mega.kv.snapkv import SnapKVPolicy
from sparse_rl_mega.kv.streaming import StreamingPolicy

ENTRY_POINT_GROUP = "sparse_rl_mega.kv_policies"  # a package's policies: ``name = package.module:Class``

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
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_policy(point.name, point.load())
        except Exception as exc:  # noqa: BLE001 (one line naming the entry point, whatever the plugin raised)
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


def resolve_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
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


def build_policy(name: str, sink: int, window: int, **settings: Any) -> EvictionPolicy:
    """Policy ``name`` with the base fields (``selection``, ``shared_scores``) and its own parameters
    in ``settings``; a bad one raises PolicyError naming it."""
    base = {key: settings.pop(key) for key in ("selection", "shared_scores") if key in settings}
    return policy_class(name)(sink=sink, window=window, **base, **resolve_params(name, settings))
