"""Declarative map between HF (Llama / Qwen2 / Qwen3) tensor names and Megatron-Core's canonical names.

Megatron's canonical state (what ``sharded_state_dict()`` describes) stacks every per-layer tensor
along a leading layer axis: ``decoder.layers.mlp.linear_fc2.weight`` is ``[num_layers, h, ffn]``. Each
entry below names one canonical tensor, its HF counterpart(s) with a ``{}`` layer placeholder, and
how the parts combine:

* ``copy``: one HF tensor per layer (or a global tensor);
* ``qkv``: q/k/v projections interleaved by query group, ``[groups * (q_per_group + 2) * head_dim, ...]``;
* ``gate_up``: SwiGLU gate and up projections concatenated along dim 0.

Family differences: Qwen2 adds q/k/v biases (fused like the weights), Qwen3 adds per-head q/k RMSNorm
weights ``[head_dim]`` (Megatron's ``q_layernorm`` / ``k_layernorm``) and may have heads wider than
``hidden / heads`` (``arch.head_dim``); untied models add ``lm_head``. :func:`fuse` and :func:`split`
work on one layer, so a loader can convert a checkpoint layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_rl_mega.config import ArchConfig


@dataclass(frozen=True)
class Entry:
    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"  # copy | qkv | gate_up
    per_layer: bool = True


def entries(arch: ArchConfig) -> list[Entry]:
    """Every canonical tensor of ``arch`` with its HF source(s)."""
    out = [
        Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), per_layer=False),
        Entry("decoder.final_layernorm.weight", ("model.norm.weight",), per_layer=False),
        Entry("decoder.layers.self_attention.linear_qkv.layer_norm_weight", ("model.layers.{}.input_layernorm.weight",)),
        Entry("decoder.layers.self_attention.linear_qkv.weight",
              tuple(f"model.layers.{{}}.self_attn.{p}_proj.weight" for p in "qkv"), kind="qkv"),
        Entry("decoder.layers.self_attention.linear_proj.weight", ("model.layers.{}.self_attn.o_proj.weight",)),
        Entry("decoder.layers.mlp.linear_fc1.layer_norm_weight", ("model.layers.{}.post_attention_layernorm.weight",)),
        Entry("decoder.layers.mlp.linear_fc1.weight",
              ("model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"), kind="gate_up"),
        Entry("decoder.layers.mlp.linear_fc2.weight", ("model.layers.{}.mlp.down_proj.weight",)),
    ]
    if arch.has_qkv_bias:
        out.append(Entry("decoder.layers.self_attention.linear_qkv.bias",
                         tuple(f"model.layers.{{}}.self_attn.{p}_proj.bias" for p in "qkv"), kind="qkv"))
    if arch.qk_layernorm:
        out += [Entry(f"decoder.layers.self_attention.{p}_layernorm.weight",
                      (f"model.layers.{{}}.self_attn.{p}_norm.weight",)) for p in "qk"]
    if not arch.tie_word_embeddings:
        out.append(Entry("output_layer.weight", ("lm_head.weight",), per_layer=False))
    return out


def hf_names(entry: Entry, layer: int | None) -> list[str]:
    """The HF tensor names of ``entry`` (for ``layer`` when the entry is per layer)."""
    return [name.format(layer) for name in entry.hf] if entry.per_layer else list(entry.hf)


def _qkv_split_sizes(arch: ArchConfig) -> tuple[int, int, int]:
    head_dim = arch.kv_channels
    return arch.num_attention_heads // arch.num_query_groups * head_dim, head_dim, head_dim


def fuse(entry: Entry, parts: list[torch.Tensor], arch: ArchConfig) -> torch.Tensor:
    """HF tensors of one layer (in ``entry.hf`` order) -> the entry's canonical tensor for that layer."""
    if entry.kind == "copy":
        return parts[0]
    if entry.kind == "gate_up":
        return torch.cat(parts, dim=0)
    groups = arch.num_query_groups
    per_group = [p.reshape(groups, -1, *p.shape[1:]) for p in parts]  # [groups, rows_per_group, ...]
    return torch.cat(per_group, dim=1).reshape(-1, *parts[0].shape[1:])


def split(entry: Entry, fused: torch.Tensor, arch: ArchConfig) -> list[torch.Tensor]:
    """Inverse of :func:`fuse` (views of ``fused``)."""
    if entry.kind == "copy":
        return [fused]
    if entry.kind == "gate_up":
        return list(torch.chunk(fused, 2, dim=0))
    grouped = fused.reshape(arch.num_query_groups, -1, *fused.shape[1:])
    q, k, v = torch.split(grouped, _qkv_split_sizes(arch), dim=1)
    return [part.reshape(-1, *fused.shape[1:]) for part in (q, k, v)]


def write_split(entry: Entry, fused: torch.Tensor, targets: list[torch.Tensor], arch: ArchConfig) -> None:
    """Copy :func:`split` of ``fused`` into ``targets`` (HF-shaped tensors, e.g. slots of a flattened
    bucket), one strided copy each: the QKV parts are copied as views of their head groups, not made
    contiguous first."""
    if entry.kind != "qkv":
        for target, part in zip(targets, split(entry, fused, arch)):
            target.copy_(part)
        return
    grouped = fused.reshape(arch.num_query_groups, -1, *fused.shape[1:])
    for target, part in zip(targets, torch.split(grouped, _qkv_split_sizes(arch), dim=1)):
        target.view(part.shape).copy_(part)


def hf_to_mcore(hf: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """HF state dict -> Megatron canonical tensors (per-layer tensors stacked on dim 0)."""
    out = {}
    for entry in entries(arch):
        layers = []
        for layer in range(arch.num_layers) if entry.per_layer else [None]:
            names = hf_names(entry, layer)
            missing = [n for n in names if n not in hf]
            if missing:
                raise KeyError(f"HF checkpoint lacks {missing[0]} (needed for {entry.mcore})")
            layers.append(fuse(entry, [hf[n] for n in names], arch))
        out[entry.mcore] = torch.stack(layers) if entry.per_layer else layers[0]
    return out


def mcore_to_hf(full: dict[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Megatron canonical tensors -> HF state dict (contiguous tensors, HF order)."""
    out = {}
    for entry in entries(arch):
        tensor = full[entry.mcore]
        if not entry.per_layer:
            for name, part in zip(entry.hf, split(entry, tensor, arch)):
                out[name] = part.contiguous()
            continue
        for layer in range(arch.num_layers):
            for name, part in zip(entry.hf, split(entry, tensor[layer], arch)):
                out[name.format(layer)] = part.contiguous()
    return out
