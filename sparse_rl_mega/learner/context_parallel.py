"""Context parallelism (CP): every sequence is split over the ranks of a CP group.

Layout (Megatron's, which its RoPE follows in ``get_pos_emb_on_this_cp_rank``): the sequence, padded
to a multiple of ``2 * CP``, is cut into ``2 * CP`` equal chunks and CP rank ``r`` holds chunks ``r``
and ``2 * CP - 1 - r``, so that under the causal mask every rank has the same attention work.

Transformer Engine's attention runs CP itself (ring exchange of keys/values). For the local layer spec
(CPU), :class:`AllGatherKVAttention` is the core attention: each rank gathers the keys and values of the
whole sequence and attends its own queries to them; its backward reduce-scatters their gradients.
The position helpers are pure and need no process group.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist


def width_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False, fp8_align: int = 1) -> int:
    """What a micro-batch's sequence width must be a multiple of: ``2 * CP`` chunks, each rank's share
    split over TP with sequence parallelism, and FP8 GEMMs' token alignment (``fp8_align``) on the
    tokens of one rank."""
    return (2 * cp_size if cp_size > 1 else 1) * (tp_size if sequence_parallel else 1) * fp8_align


def padded_width(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple``."""
    return -(-width // multiple) * multiple


def cp_positions(width: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Sequence positions ``[width / cp_size]`` held by CP rank ``cp_rank`` (``width`` a multiple of
    ``2 * cp_size``): chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank``."""
    if cp_size == 1:
        return torch.arange(width)
    if width % (2 * cp_size):
        raise ValueError(f"sequence width {width} is not a multiple of 2 x CP = {2 * cp_size}")
    chunk = width // (2 * cp_size)
    last = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange(last * chunk, (last + 1) * chunk)])


def split_sequence(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of ``tensor`` along its sequence axis ``dim`` (width a multiple of 2 x CP)."""
    return tensor.index_select(dim, cp_positions(tensor.shape[dim], cp_size, cp_rank).to(tensor.device))


def merge_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every CP rank's part (``parts`` in CP rank order): inverse of
    :func:`split_sequence`."""
    cp_size = len(parts)
    width = parts[0].shape[dim] * cp_size
    shape = list(parts[0].shape)
    shape[dim] = width
    full = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        full.index_copy_(dim, cp_positions(width, cp_size, rank).to(part.device), part)
    return full


def gather_sequence(local: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = 1) -> torch.Tensor:
    """Every CP rank's part of a (non-differentiable) tensor gathered and put in sequence order."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return merge_sequence(parts, dim)


def _sequence_order(width: int, cp_size: int) -> torch.Tensor:
    """For rows gathered rank after rank (each rank's :func:`cp_positions`), the row holding each
    sequence position: index ``[width]`` that puts the gathered rows in sequence order."""
    gathered = torch.cat([cp_positions(width, cp_size, rank) for rank in range(cp_size)])
    return torch.argsort(gathered)


class AllGatherKVAttention(torch.nn.Module):
    """Causal core attention of one CP rank for the local layer spec (a stand-in for Megatron's
    ``DotProductAttention``, which refuses CP; same constructor and ``forward`` signature).

    ``query`` ``[s/cp, b, heads/tp, d]`` holds this rank's two chunks, ``key``/``value``
    ``[s/cp, b, groups/tp, d]`` likewise. Keys and values of the whole sequence are all-gathered over the
    CP group (Megatron's sequence-parallel gather, whose backward reduce-scatters the gradients, so each
    rank's keys receive the gradient of every rank's queries); the mask is causal in global positions.
    Memory: the full sequence's keys and values per layer, one ``[s/cp, s]`` score matrix per head.
    """

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__()
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        self.config = config
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.cp_group = ps.get_context_parallel_group()
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("AllGatherKVAttention has no attention dropout (RL fine-tuning runs without it)")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("AllGatherKVAttention supports neither attention bias nor packed sequences")
        cp_size, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        local, batch = query.shape[0], query.shape[1]
        width = local * cp_size
        order = _sequence_order(width, cp_size).to(query.device)
        # [s, b, groups, d] in sequence order, every rank's keys and values
        keys = gather_from_sequence_parallel_region(key.contiguous(), True, self.cp_group).index_select(0, order)
        values = gather_from_sequence_parallel_region(value.contiguous(), True, self.cp_group).index_select(0, order)
        if self.heads > self.groups:  # grouped-query attention: each key/value head serves several queries
            keys = keys.repeat_interleave(self.heads // self.groups, dim=2)
            values = values.repeat_interleave(self.heads // self.groups, dim=2)
        compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        scores = torch.einsum("qbhd,kbhd->bhqk", query.to(compute), keys.to(compute)) * self.softmax_scale
        query_positions = cp_positions(width, cp_size, cp_rank).to(query.device)
        future = torch.arange(width, device=query.device)[None, :] > query_positions[:, None]  # [s/cp, s]
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        context = torch.einsum("bhqk,kbhd->qbhd", probs, values.to(compute)).to(query.dtype)
        return context.reshape(local, batch, self.heads * query.shape[-1])
