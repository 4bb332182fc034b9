"""The learner's half of a weight push: every HF tensor planned into a flattened bucket (one contiguous
byte buffer holding several tensors at known offsets, SGLang's ``flattened_bucket`` layout), and each
bucket packed by the one rank that owns it.

A bucket's tensors all come from one *owner*: the rank holding the first piece of each of its Megatron
tensors (TP rank 0 of the pipeline stage, main data-parallel replica). The owner writes its own shards
straight into the bucket, in the HF layout (QKV de-interleaved, gate/up split, cast to the push dtype):
one copy per byte. Pieces held by the other TP ranks of the stage are sent to the owner point to point,
in plan order, while it packs that bucket.

Every rank builds the same :class:`PushPlan` from the metadata of every rank's shards (one
``all_gather_object``), so engine hosts know each bucket's names, shapes and offsets without a byte
of the weights.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sparse_rl_mega.config import ArchConfig
from sparse_rl_mega.learner.hf_map import Entry, entries, hf_names, split, write_split
from sparse_rl_mega.learner.weights import piece_table


@dataclass(frozen=True)
class Slot:
    """One HF tensor in a flattened bucket."""
    name: str
    shape: tuple[int, ...]
    offset: int  # bytes from the bucket's start
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """One main-replica shard of a Megatron tensor: who holds it and where it sits in the full tensor."""
    rank: int
    index: tuple  # slices into the full (per-layer) tensor
    number: int   # its position in that rank's shard list


@dataclass
class Group:
    """One Megatron tensor of one layer (``layer`` -1: not per layer) and the HF slots it fills."""
    key: str
    layer: int
    entry: Entry
    shape: tuple[int, ...]    # the full (per-layer) tensor
    source_dtype: torch.dtype
    pieces: list[Piece]
    slots: list[Slot] = field(default_factory=list)  # in the entry's HF order


@dataclass
class PlannedBucket:
    index: int
    owner: int
    groups: list[Group]
    nbytes: int

    @property
    def slots(self) -> list[Slot]:
        return [slot for group in self.groups for slot in group.slots]


@dataclass
class PushPlan:
    """Every bucket of a push, in push order; identical on every rank."""
    dtype: torch.dtype
    buckets: list[PlannedBucket]

    def owned_by(self, rank: int) -> list[PlannedBucket]:
        return [b for b in self.buckets if b.owner == rank]

    @property
    def owners(self) -> list[int]:
        return sorted({b.owner for b in self.buckets})

    def buffer_bytes(self, owner: int) -> tuple[int, int]:
        """The sizes of ``owner``'s two buffers: its j-th bucket goes into buffer j % 2."""
        mine = self.owned_by(owner)
        return tuple(max((b.nbytes for b in mine[slot::2]), default=0) for slot in (0, 1))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def tensors(self) -> int:
        return sum(len(b.slots) for b in self.buckets)


def plan_push(shards: list, arch: ArchConfig, dtype: torch.dtype, bucket_bytes: int) -> PushPlan:
    """The buckets of a push of this model (collective). ``shards``: this rank's
    ``_local_shards(modules, main_replica_only=True)``. A bucket holds whole HF tensors of one owner,
    at most ``bucket_bytes`` of them in ``dtype`` (a larger tensor goes alone)."""
    by_key = {entry.mcore: entry for entry in entries(arch)}
    order = {key: i for i, key in enumerate(by_key)}
    groups = {(key, layer): Group(key, layer, by_key[key], pieces[0][1], getattr(torch, pieces[0][3]),
                                  [Piece(rank, index, number) for rank, _, index, _, number in pieces])
              for (key, layer), pieces in piece_table(shards, arch).items()}
    itemsize = dtype.itemsize
    ordered = []
    for (key, layer), group in groups.items():  # (pieces in rank order: the first one's rank owns it)
        ordered.append((group.pieces[0].rank, layer, order[key], group))
    ordered.sort(key=lambda g: g[:3])  # each owner's tensors together, by layer, in HF order
    per_owner: dict[int, list[PlannedBucket]] = {}
    for owner, _, _, group in ordered:
        entry = group.entry
        parts = split(entry, torch.empty(group.shape, device="meta"), arch)
        names = hf_names(entry, group.layer if entry.per_layer else None)
        nbytes = sum(part.numel() for part in parts) * itemsize
        owned = per_owner.setdefault(owner, [])
        if not owned or (owned[-1].nbytes and owned[-1].nbytes + nbytes > bucket_bytes):
            owned.append(PlannedBucket(0, owner, [], 0))
        last = owned[-1]
        offset = last.nbytes
        for name, part in zip(names, parts):
            size = part.numel() * itemsize
            group.slots.append(Slot(name, tuple(part.shape), offset, size))
            offset += size
        last.groups.append(group)
        last.nbytes = offset
    # the owners' buckets taken in turn, so that every owner packs while the engines load another's
    buckets = [b for turn in itertools.zip_longest(*per_owner.values()) for b in turn if b is not None]
    for number, bucket in enumerate(buckets):
        bucket.index = number
    for group in groups.values():
        covered = sum(torch.empty(group.shape, device="meta")[p.index].numel() for p in group.pieces)
        if covered != torch.Size(group.shape).numel():
            raise RuntimeError(f"{group.key} layer {group.layer}: the shards hold {covered} of "
                               f"{torch.Size(group.shape).numel()} elements")
    return PushPlan(dtype, buckets)


def _slot_view(flat: torch.Tensor, slot: Slot, dtype: torch.dtype) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape)


def _write_split(group: Group, full: torch.Tensor, flat: torch.Tensor, dtype: torch.dtype, arch: ArchConfig) -> None:
    """The HF tensors of the full Megatron tensor ``full``, written into their slots of ``flat``."""
    write_split(group.entry, full, [_slot_view(flat, slot, dtype) for slot in group.slots], arch)


def _adjacent(group: Group) -> bool:
    """Whether the group's HF tensors, side by side in its slots, are the full tensor's own layout
    (copy: one tensor; gate/up: two halves along dim 0), so pieces can be written straight into them."""
    return group.entry.kind in ("copy", "gate_up")


@torch.no_grad()
def pack_bucket(plan: PushPlan, bucket: PlannedBucket, flat: torch.Tensor, shards: list, arch: ArchConfig) -> None:
    """The owner: fill ``flat`` (a uint8 buffer of at least ``bucket.nbytes``) with the bucket's HF
    tensors, receiving the pieces other ranks hold (they call :func:`send_pieces` for this bucket)."""
    rank, dtype = dist.get_rank(), plan.dtype
    for group in bucket.groups:
        whole = len(group.pieces) == 1
        if whole and group.pieces[0].rank == rank:  # one local shard: straight into the slots
            _write_split(group, shards[group.pieces[0].number].data.detach(), flat, dtype, arch)
            continue
        if _adjacent(group):  # the slots are the full tensor: pieces land in place
            first = group.slots[0]
            full = flat[first.offset:first.offset + sum(s.nbytes for s in group.slots)].view(dtype).view(group.shape)
        else:
            full = torch.empty(group.shape, dtype=group.source_dtype, device=flat.device)
        for piece in group.pieces:
            target = full[piece.index]
            if piece.rank == rank:
                target.copy_(shards[piece.number].data.detach())
            elif target.is_contiguous() and target.dtype == group.source_dtype:
                dist.recv(target, src=piece.rank)
            else:
                received = torch.empty(target.shape, dtype=group.source_dtype, device=flat.device)
                dist.recv(received, src=piece.rank)
                target.copy_(received)
        if not _adjacent(group):
            _write_split(group, full, flat, dtype, arch)


@torch.no_grad()
def send_pieces(bucket: PlannedBucket, shards: list) -> None:
    """A rank other than the bucket's owner: send the pieces it holds, in the order the owner receives."""
    rank = dist.get_rank()
    for group in bucket.groups:
        for piece in group.pieces:
            if piece.rank == rank:
                dist.send(shards[piece.number].data.detach().contiguous(), dst=bucket.owner)


def holds_pieces(bucket: PlannedBucket, rank: int) -> bool:
    return bucket.owner != rank and any(p.rank == rank for g in bucket.groups for p in g.pieces)
