"""The one reader of an HF model folder's ``config.json``: ``model.arch`` filled from it, checked against it,
and the shape the engine's sizing needs."""
from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, Optional

from sparse_rl_mega.config.errors import ConfigError, require
from sparse_rl_mega.config.model import ArchConfig, RopeScalingConfig, rope_scaling_problem


def fill_arch_from_folder(raw: dict[str, Any], source: str) -> list[str]:
    """Fill the ``model.arch`` fields that ``raw`` leaves out from the HF ``config.json`` in ``model.path``
    (``family`` from its ``model_type``), in place; returns the names filled. Fields written in the
    config stay as written (and are checked against the folder by :func:`validate`). Without a folder
    to read, the section must be written out, unless ``model.create_tiny`` builds the model from it."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("path"), str) or not model["path"]:
        return []  # (reported by _build / validate, naming the key)
    given = model.get("arch")
    if given is not None and not isinstance(given, dict):
        return []
    hf_config = Path(model["path"]) / "config.json"
    if not hf_config.is_file():
        if given is None and model.get("create_tiny") is None:
            raise ConfigError(f"{source}: model.arch: not given, and {hf_config} does not exist here to read it "
                              "from: write the model.arch section, or run where the model folder is")
        return []
    read = arch_from_hf_config(model["path"], source)
    filled = [name for name in read if name not in (given or {})]
    model["arch"] = {**{name: read[name] for name in filled}, **(given or {})}
    return filled


def read_hf_config(model_dir: str | Path, source: Optional[str] = None) -> dict[str, Any]:
    """An HF folder's ``config.json`` as a dict; one that cannot be read raises :class:`ConfigError`."""
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ConfigError(f"{source + ': ' if source else ''}model.path: {path} cannot be read as JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{source + ': ' if source else ''}model.path: {path} holds no JSON object")
    return hf


def arch_from_hf_config(model_dir: str | Path, source: Optional[str] = None) -> dict[str, Any]:
    """``model.arch`` values read from an HF folder's ``config.json`` (the keys it defines).

    Reads both config layouts of transformers (``rope_theta`` at the top and ``rope_scaling``, 4.x, or
    both inside ``rope_parameters``, 5.x). HF features the Megatron map cannot represent (another model
    type, RoPE scaling other than llama3 / linear, MLP biases, sliding-window attention) raise
    :class:`ConfigError` naming the file and key."""
    path = Path(model_dir) / "config.json"
    hf = read_hf_config(model_dir, source)
    names = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
             "num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
             "head_dim": "head_dim", "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
             "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings"}
    arch = {ours: hf[theirs] for ours, theirs in names.items() if hf.get(theirs) is not None}
    arch.setdefault("num_query_groups", arch.get("num_attention_heads"))
    model_type = hf.get("model_type")
    if model_type is not None:
        if model_type not in _HF_FAMILIES:
            raise ConfigError(f"{path}: model_type {model_type!r} is not supported; expected one of: "
                              f"{', '.join(_HF_FAMILIES)}")
        arch["family"] = model_type
    rope_key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{path}: {rope_key} = {rope!r}: expected a mapping")
    if rope.get("rope_theta") is not None:
        arch["rope_theta"] = rope["rope_theta"]
    scaling = _rope_scaling(hf, rope, f"{path}: {rope_key}")
    if scaling is not None:
        arch["rope_scaling"] = scaling
    for key in ("mlp_bias", "use_sliding_window"):
        if hf.get(key):
            raise ConfigError(f"{path}: {key} = {hf[key]!r} is not supported")
    if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
        arch["qkv_bias"] = True  # rejected by validation, naming model.arch.qkv_bias
    return arch


_HF_FAMILIES = typing.get_args(typing.get_type_hints(ArchConfig)["family"])
# per supported rope type: the keys of its HF section (besides rope_type / type, rope_theta)
_ROPE_KEYS = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "linear": ("factor",)}


def _rope_scaling(hf: dict[str, Any], rope: dict[str, Any], where: str) -> Optional[dict[str, Any]]:
    """``model.arch.rope_scaling`` from an HF rope section (``where``: its file and key, for errors);
    None for plain RoPE. Other rope types, keys and values that cannot be raise :class:`ConfigError`."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_KEYS:
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported (supported: default, "
                          f"{', '.join(_ROPE_KEYS)}; Megatron-Core has no {rope_type!r} scaling of RoPE)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor = {rope['partial_rotary_factor']!r} is not supported")
    extra = sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", *_ROPE_KEYS[rope_type]})
    if extra:
        raise ConfigError(f"{where}: {extra[0]} is not supported with rope_type {rope_type!r}")
    values = {key: rope[key] for key in _ROPE_KEYS[rope_type] if rope.get(key) is not None}
    if rope_type == "llama3" and hf.get("original_max_position_embeddings") is not None:
        values["original_max_position_embeddings"] = hf["original_max_position_embeddings"]  # (transformers' priority)
    for key, value in values.items():
        integral = key == "original_max_position_embeddings"
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise ConfigError(f"{where}: {key} = {value!r}: expected {'an integer' if integral else 'a number'}")
    problem = rope_scaling_problem(RopeScalingConfig(rope_type=rope_type, **values))
    if problem:
        raise ConfigError(f"{where}: {problem[0]} {problem[1]}")
    return {"rope_type": rope_type, **values}


def hf_rope_parameters(arch: ArchConfig) -> dict[str, Any]:
    """transformers' ``rope_parameters`` (5.x) of ``arch``: rope_type, rope_theta and the scaling's keys."""
    s = arch.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": arch.rope_theta}
    return {"rope_type": s.rope_type, "rope_theta": arch.rope_theta,
            **{key: getattr(s, key) for key in _ROPE_KEYS[s.rope_type] if getattr(s, key) is not None}}


def _check_rope_scaling(a: ArchConfig, hf_arch: dict[str, Any], hf_config: Path, source: str) -> None:
    """``model.arch.rope_scaling`` against the folder's (floats within 1e-6 relative; llama3's original
    positions as each side resolves them)."""
    ours, theirs = a.rope_scaling, hf_arch.get("rope_scaling")
    types = [f"rope_type {s['rope_type']!r}" if s else "none (plain RoPE)" for s in (ours and vars(ours), theirs)]
    require(types[0] == types[1], source, "model.arch.rope_scaling", f"{types[0]} disagrees with {hf_config} ({types[1]})")
    if ours is None or theirs is None:  # (both None, or the types disagreed: refused above)
        return
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        mine, hers = getattr(ours, name), theirs.get(name)
        require((mine is None and hers is None) or (None not in (mine, hers) and abs(mine - hers) <= 1e-6 * abs(hers)),
                source, f"model.arch.rope_scaling.{name}", f"{mine} disagrees with {hf_config} ({hers})")
    if ours.rope_type == "llama3":
        hers = theirs.get("original_max_position_embeddings", hf_arch.get("max_position_embeddings"))
        require(a.rope_original_positions == hers, source, "model.arch.rope_scaling.original_max_position_embeddings",
                f"{a.rope_original_positions} disagrees with {hf_config} ({hers})")


def check_against_hf_config(cfg: Any, source: str) -> None:  # (cfg: a RunConfig)
    """When the model folder exists, its config.json must agree with ``model.arch``."""
    hf_config = Path(cfg.model.path) / "config.json"
    if not hf_config.is_file():
        require(cfg.model.create_tiny is not None or not Path(cfg.model.path).exists(), source, "model.path",
                f"{cfg.model.path} exists but has no config.json")
        return
    hf_arch = arch_from_hf_config(cfg.model.path)
    a = cfg.model.arch
    for name in ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "vocab_size", "tie_word_embeddings", "max_position_embeddings", "qkv_bias"):
        ours = getattr(a, name)
        require(name not in hf_arch or ours == hf_arch[name], source, f"model.arch.{name}",
                f"{ours} disagrees with {hf_config} ({hf_arch.get(name)})")
    # HF's head width: head_dim where written, else hidden_size / num_attention_heads (as transformers derives it)
    hf_head_dim = hf_arch.get("head_dim") or (hf_arch["hidden_size"] // hf_arch["num_attention_heads"]
                                              if "hidden_size" in hf_arch and hf_arch.get("num_attention_heads") else None)
    require(hf_head_dim is None or a.kv_channels == hf_head_dim, source, "model.arch.head_dim",
            f"heads of width {a.kv_channels} disagree with {hf_config} (heads of width {hf_head_dim}"
            + (")" if "head_dim" in hf_arch else " = hidden_size / num_attention_heads)"))
    for name in ("rope_theta", "norm_eps"):  # floats (HF may store 1e-5 as 9.99999974e-06)
        ours = getattr(a, name)
        require(name not in hf_arch or abs(ours - hf_arch[name]) <= 1e-6 * abs(hf_arch[name]), source,
                f"model.arch.{name}", f"{ours} disagrees with {hf_config} ({hf_arch.get(name)})")
    _check_rope_scaling(a, hf_arch, hf_config, source)


def hf_shape(model_path: str | Path) -> dict[str, int]:
    """What sizing an engine's buffers needs of the model in ``model_path``: layers, heads, KV heads,
    head width and vocabulary (any model SGLang serves: the family is not checked here)."""
    hf = read_hf_config(model_path)
    heads = hf["num_attention_heads"]
    return {"layers": hf["num_hidden_layers"], "heads": heads, "kv_heads": hf.get("num_key_value_heads", heads),
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "vocab": hf["vocab_size"]}
