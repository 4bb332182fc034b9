"""Move whole weights between an HF folder / the rollout engines and this rank's Megatron shards.

Both directions use Megatron's own sharding metadata: ``sharded_state_dict()`` (with factories
applied, which splits SwiGLU fc1 into its gate and up pieces) gives, for every local shard, its
canonical key, global shape and offset, whatever the TP/PP layout.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.config import ArchConfig
from sparse_rl_mega.learner.hf_map import hf_to_mcore, mcore_to_hf


def _local_shards(module: torch.nn.Module, main_replica_only: bool) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = module.sharded_state_dict()
    apply_factories(state)
    shards = []
    for value in nested_values(state):
        if not isinstance(value, ShardedTensor):
            continue  # _extra_state objects
        replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
        if main_replica_only and any(r != 0 for r in replica):
            continue
        shards.append(value)
    return shards


def _index(shard) -> tuple:
    """Index of ``shard`` inside its canonical (global) tensor."""
    prepend = shard.prepend_axis_num
    offsets = shard.global_offset
    return tuple(offsets[:prepend]) + tuple(slice(o, o + s) for o, s in zip(offsets[prepend:], shard.data.shape))


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors files")
    state = {}
    for path in files:
        state.update(load_file(str(path)))
    return state


@torch.no_grad()
def load_hf_into_model(module: torch.nn.Module, hf_dir: str | Path, arch: ArchConfig) -> None:
    """Copy an HF checkpoint into this rank's shards (every replica, so TP/DP copies agree)."""
    canonical = hf_to_mcore(read_hf_state_dict(hf_dir), arch)
    for shard in _local_shards(module, main_replica_only=False):
        if shard.key not in canonical:
            raise KeyError(f"no HF tensor maps to Megatron tensor {shard.key}")
        source = canonical[shard.key]
        if tuple(source.shape) != tuple(shard.global_shape):
            raise ValueError(f"{shard.key}: HF gives shape {tuple(source.shape)}, model expects {shard.global_shape}")
        shard.data.copy_(source[_index(shard)])


@torch.no_grad()
def gather_hf_state_dict(module: torch.nn.Module, arch: ArchConfig, dst: int = 0) -> Optional[dict[str, torch.Tensor]]:
    """Full HF-named weights on global rank ``dst`` (None elsewhere), from the main-replica shards of
    every TP/PP rank. Transport is one ``gather_object`` (fine at CPU-test scale; per-tensor TP
    all-gathers and PP sends replace it for real models)."""
    pieces = [(s.key, tuple(s.global_shape), _index(s), s.data.detach().to("cpu", copy=True))
              for s in _local_shards(module, main_replica_only=True)]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(pieces, gathered, dst=dst)
    if dist.get_rank() != dst:
        return None
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for rank_pieces in gathered:
        for key, global_shape, index, data in rank_pieces:
            if key not in full:
                full[key] = torch.empty(global_shape, dtype=data.dtype)
                filled[key] = 0
            full[key][index] = data
            filled[key] += data.numel()
    for key, tensor in full.items():
        if filled[key] != tensor.numel():
            raise RuntimeError(f"{key}: gathered {filled[key]} of {tensor.numel()} elements")
    return mcore_to_hf(full, arch)


def buckets(named: dict[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Split HF-named tensors into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, tensor in named.items():
        tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
