"""YAML -> :class:`RunConfig`: overrides, the type of every value, unknown keys named, then validation."""
from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from sparse_rl_mega.config.algorithm import CorrectionConfig
from sparse_rl_mega.config.errors import ConfigError
from sparse_rl_mega.config.hf import fill_arch_from_folder
from sparse_rl_mega.config.rollout import KVCompressionConfig, policy_param_names
from sparse_rl_mega.config.run import RunConfig
from sparse_rl_mega.config.validation import validate


def load_config(path: str | Path, overrides: Optional[list[str]] = None) -> RunConfig:
    """Load, type-check and validate a YAML config; ``overrides`` are ``dotted.key=yaml_value``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = config_from_dict(raw, str(path))
    cfg.config_path = str(path)  # type: ignore[misc]  # (an attribute outside the fields: not in to_dict)
    return cfg


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Build and validate a config from its YAML tree; ``model.arch`` fields left out are read from the
    model folder's config.json (:func:`fill_arch_from_folder`)."""
    from_folder = fill_arch_from_folder(raw, source)
    cfg: RunConfig = _build(RunConfig, raw, "", source)
    cfg.arch_from_folder = from_folder  # type: ignore[misc]  # (outside the fields, as config_path)
    validate(cfg, source)
    return cfg


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. trainer.iterations=5")
    key, value = item.split("=", 1)
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        if node.get(part) is None:  # (absent, or an optional section set to null: its field makes it a section)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(value)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if dataclasses.is_dataclass(tp):
        return "a mapping (section)"
    return getattr(tp, "__name__", str(tp))


_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key, source)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{source}: {key} = {value!r}: expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping (section), got {value!r}")
        return _build(typing.cast(type, tp), value, key + ".", source)
    if tp is dict or typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value):
        return float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and type(value) is tp:
        return value
    raise ConfigError(f"{source}: {key} = {value!r}: expected {_type_name(tp)}, got {type(value).__name__}")


def _build(cls: type, raw: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            if cls is KVCompressionConfig and key in policy_param_names():  # the section's former shape
                raise ConfigError(f"{source}: {prefix}{key}: a KV policy's own parameters now go under "
                                  f"{prefix}params: write `params: {{{key}: {raw[key]}}}`")
            raise ConfigError(f"{source}: unknown key {prefix}{key}; expected one of: {', '.join(names)}")
    kwargs = {name: _coerce(hints[name], raw[name], prefix + name, source) for name in names if name in raw}
    if cls is CorrectionConfig:  # the preset fills what the YAML does not say
        return CorrectionConfig.from_preset(kwargs.pop("preset", "sparse_rl"), **kwargs)
    return cls(**kwargs)


def load_config_or_exit(path: str | Path, overrides: Optional[list[str]] = None) -> RunConfig:
    """:func:`load_config` for the command-line tools: a problem is printed as one ``config error:``
    line and the tool exits with status 2."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
