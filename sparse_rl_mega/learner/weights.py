"""Move whole weights between an HF folder / the rollout engines and this rank's Megatron shards.

Both directions use Megatron's own sharding metadata: ``sharded_state_dict()`` (with factories
applied, which splits SwiGLU fc1 into its gate and up pieces) gives, for every local shard, its
canonical key, global shape and offset, whatever the TP/PP layout.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from sparse_rl_mega.config import ArchConfig
from sparse_rl_mega.learner.hf_map import entries, fuse, hf_names, split


def as_chunks(modules) -> list[torch.nn.Module]:
    """This rank's model chunks as a list (a single module is one chunk)."""
    return list(modules) if isinstance(modules, (list, tuple)) else [modules]


def chunks_sharded_state_dict(modules) -> dict:
    """One sharded state dict for this rank's chunks: the chunk's own with one chunk, else
    ``{"chunk0": ..., "chunk1": ...}``. Shards are matched by their global keys (layers carry their
    global number), so checkpoints load across any layout, virtual stages or not."""
    chunks = as_chunks(modules)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _local_shards(modules, main_replica_only: bool) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = chunks_sharded_state_dict(modules)
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


class _LazyHFCheckpoint:
    """An HF safetensors checkpoint (one file or several) opened lazily: only the headers are read up
    front; a tensor, or a slice of one, is read from the memory-mapped file when asked for."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{hf_dir}: no *.safetensors files")
        self.where: dict[str, object] = {}
        for path in files:
            handle = safe_open(str(path), framework="pt")
            for name in handle.keys():
                self.where[name] = handle

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def read(self, name: str, index: Optional[tuple] = None) -> torch.Tensor:
        if index is None:
            return self.where[name].get_tensor(name)
        return self.where[name].get_slice(name)[index]


@torch.no_grad()
def load_hf_into_model(modules, hf_dir: str | Path, arch: ArchConfig,
                       keep: Optional[dict[int, torch.Tensor]] = None) -> None:
    """Copy an HF checkpoint into this rank's shards of ``modules`` (its model chunks, or one module;
    every replica, so TP/DP copies agree).

    Only what this rank holds is read: the layers of its pipeline stage (the stacked layer axis of a
    shard's canonical key gives the global layer), the embedding / final norm / output layer only on
    the stages that have them, and for tensors that are not fused, only this rank's TP slice. Fused
    tensors (QKV, gate/up) are read and fused one layer at a time, so the memory this needs beyond the
    model is about one layer's largest tensor. Missing HF tensors raise ``KeyError``, shapes that
    disagree with the model raise ``ValueError``; both name the tensor. ``keep`` (given): the values
    written into each FP8 parameter, as read (by ``id`` of the parameter; see :func:`master_values`)."""
    checkpoint = _LazyHFCheckpoint(hf_dir)
    by_key = {entry.mcore: entry for entry in entries(arch)}
    extra_layer = f"model.layers.{arch.num_layers}.input_layernorm.weight"
    if extra_layer in checkpoint.where:
        raise ValueError(f"{hf_dir}: HF checkpoint has more layers than model.arch.num_layers={arch.num_layers}")

    work: dict[tuple[int, int, str], list] = {}  # (layer + 1 or 0, entry order, key) -> this rank's shards
    order = {key: i for i, key in enumerate(by_key)}
    for shard in _local_shards(modules, main_replica_only=False):
        entry = by_key.get(shard.key)
        if entry is None:
            raise KeyError(f"no HF tensor maps to Megatron tensor {shard.key}")
        if shard.prepend_axis_num != int(entry.per_layer):
            raise RuntimeError(f"{shard.key}: expected {int(entry.per_layer)} stacked layer axis, "
                               f"got {shard.prepend_axis_num}")
        layer = shard.global_offset[0] if entry.per_layer else -1
        work.setdefault((layer + 1, order[shard.key], shard.key), []).append(shard)

    for (slot, _, key), shards in sorted(work.items()):
        entry = by_key[key]
        layer = slot - 1 if entry.per_layer else None
        names = hf_names(entry, layer)
        for name in names:
            if name not in checkpoint.where:
                raise KeyError(f"{hf_dir}: HF checkpoint lacks {name} (needed for {key})")
        prepend = shards[0].prepend_axis_num
        canonical_shape = tuple(shards[0].global_shape[prepend:])
        expected = [tuple(part.shape) for part in split(entry, torch.empty(canonical_shape, device="meta"), arch)]
        for name, want in zip(names, expected):
            if checkpoint.shape(name) != want:
                raise ValueError(f"{name}: HF gives shape {checkpoint.shape(name)}, model expects {want} "
                                 f"(for {key} {shards[0].global_shape})")
        if entry.kind == "copy":  # read just the slice each shard holds
            for shard in shards:
                _write(shard.data, checkpoint.read(names[0], _index(shard)[prepend:]), keep)
            continue
        fused = fuse(entry, [checkpoint.read(name) for name in names], arch)
        for shard in shards:
            _write(shard.data, fused[_index(shard)[prepend:]], keep)
        del fused


def _write(param: torch.Tensor, value: torch.Tensor, keep: Optional[dict[int, torch.Tensor]]) -> None:
    param.copy_(value)
    if keep is not None and is_fp8(param):
        keep[id(param)] = value.clone()  # (a slice of a fused tensor: its own copy, on the CPU)


def is_fp8(param: torch.Tensor) -> bool:
    """Whether ``param`` holds FP8 values (Transformer Engine's quantized tensors, ``model.fp8_param``)."""
    from megatron.core.fp8_utils import is_float8tensor

    return is_float8tensor(param)


def master_values(chunks: list, kept: dict[int, torch.Tensor], fp8=is_fp8, log=print) -> Optional[dict]:
    """The values to initialise the optimizer's fp32 master weights from, as Megatron's
    ``reload_model_params(state_dict)`` takes them (``{"model<i>": {parameter name: tensor}}``, every
    parameter of every chunk): an FP8 parameter's as read from the checkpoint (``kept``), the others'
    the parameter itself. None without FP8 parameters (the masters are copied from the parameters).
    Megatron otherwise dequantizes FP8 parameters into the masters (``distrib_optimizer.py``: "there
    will be a loss of precision"), and the model would start from FP8-rounded weights."""
    named = [list(chunk.named_parameters()) for chunk in chunks]
    if not any(fp8(param) for params in named for _, param in params):
        return None
    out, rounded = {}, []
    for i, params in enumerate(named):
        values = {}
        for name, param in params:
            if fp8(param) and id(param) not in kept:
                # written through a view (the SwiGLU fc1 halves): Megatron dequantizes it, said in one line
                rounded.append(name)
            while name.startswith("module."):  # (as Megatron matches them: DDP and Float16Module wrappers)
                name = name[len("module."):]
            values[name] = kept.get(id(param), param) if fp8(param) else param.detach()
        out[f"model{i}"] = values
    if rounded:
        log(f"[setup] model.fp8_param: the master weights of {len(rounded)} FP8 parameter(s) written through views "
            f"come from their FP8 values (e.g. {rounded[0]}); the others from the checkpoint's")
    return out


def load_hf_into_learner(learner, hf_dir: str | Path, arch: ArchConfig) -> None:
    """:func:`load_hf_into_model` for a learner's chunks, then its optimizer's master weights are
    refreshed from them: a bfloat16 optimizer copied fp32 masters of the initial weights when it was
    built, and its first step would write those back over the loaded ones. With FP8 parameters the
    masters are the checkpoint's values (:func:`master_values`)."""
    kept: dict[int, torch.Tensor] = {}
    load_hf_into_model(learner.modules, hf_dir, arch, keep=kept)
    # FP8 parameters (model.fp8_param): the masters come from the checkpoint's values, not the FP8 ones
    learner.optimizer.reload_model_params(state_dict=master_values(learner.chunks, kept))


def piece_table(shards: list, arch: ArchConfig) -> dict[tuple[str, int], list[tuple]]:
    """Where every piece of every canonical tensor is (collective: one ``all_gather_object`` of the
    metadata, no weights): ``{(key, layer): [(rank, full shape, index, dtype name, number), ...]}``, in
    rank order, from each rank's ``shards`` (``_local_shards(modules, main_replica_only=True)``);
    ``layer`` is -1 for a tensor that is not per layer, ``number`` the piece's place in its rank's list."""
    mine = []
    for number, shard in enumerate(shards):
        index, prepend = _index(shard), shard.prepend_axis_num
        mine.append((shard.key, index[0] if prepend else -1, tuple(shard.global_shape[prepend:]), index[prepend:],
                     str(shard.data.dtype).replace("torch.", ""), number))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    known = {entry.mcore for entry in entries(arch)}
    table: dict[tuple[str, int], list[tuple]] = {}
    for rank, pieces in enumerate(everyone):
        for key, layer, shape, index, dtype, number in pieces:
            if key not in known:
                raise KeyError(f"no HF name for Megatron tensor {key}")
            table.setdefault((key, layer), []).append((rank, shape, index, dtype, number))
    return table


@torch.no_grad()
def stream_hf_tensors(modules, arch: ArchConfig, dst: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors, one layer's piece at a time, on global rank ``dst``.

    Every rank must iterate this to the end (elsewhere it yields nothing, but sends its pieces).
    Pieces are the main-replica shards of every TP/PP rank; for each canonical tensor and layer
    (in one global order) ``dst`` assembles the full tensor from its own pieces and point-to-point
    receives from the ranks that own the others (the TP ranks of the PP stage holding that layer),
    then yields its HF tensors. Memory on ``dst`` beyond its shards: one layer's largest tensor plus
    what the consumer keeps."""
    rank = dist.get_rank()
    shards = _local_shards(modules, main_replica_only=True)
    groups = piece_table(shards, arch)
    by_key = {entry.mcore: entry for entry in entries(arch)}
    order = {key: i for i, key in enumerate(by_key)}
    for (key, layer) in sorted(groups, key=lambda g: (g[1], order[g[0]])):
        pieces = groups[(key, layer)]
        full = None
        filled = 0
        for owner, shape, index, dtype, number in pieces:
            if rank == dst:
                if full is None:
                    full = torch.empty(shape, dtype=getattr(torch, dtype))
                if owner == dst:
                    full[index] = shards[number].data.detach().to("cpu")
                else:
                    buffer = torch.empty(full[index].shape, dtype=full.dtype)
                    dist.recv(buffer, src=owner)
                    full[index] = buffer
                filled += full[index].numel()
            elif rank == owner:
                dist.send(shards[number].data.detach().to("cpu").contiguous(), dst=dst)
        if rank != dst:
            continue
        if filled != full.numel():
            raise RuntimeError(f"{key} layer {layer}: gathered {filled} of {full.numel()} elements")
        entry = by_key[key]
        names = hf_names(entry, layer if entry.per_layer else None)
        for name, part in zip(names, split(entry, full, arch)):
            yield name, part.contiguous()


def gather_hf_state_dict(modules, arch: ArchConfig, dst: int = 0) -> Optional[dict[str, torch.Tensor]]:
    """Full HF-named weights on global rank ``dst`` (None elsewhere); see :func:`stream_hf_tensors`."""
    named = dict(stream_hf_tensors(modules, arch, dst))
    return named if dist.get_rank() == dst else None


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
            dtype: torch.dtype) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, cast to ``dtype``, into lists of at most ``bucket_bytes`` (a
    larger tensor goes alone). Consumes ``named`` lazily, so a stream is never held whole."""
    bucket, size = [], 0
    for name, tensor in named:
        tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
