"""One weight push from the learner's ranks to every engine, bucket by bucket
(:mod:`sparse_rl_mega.learner.flat_buckets` plans and packs the buckets).

Each engine gets the buckets by one of two transports:

* ``shared``: the engine's scheduler reads the bucket from the owner's buffer itself, through SGLang's
  ``update_weights_from_tensor(load_format="flattened_bucket")``: the buffer is host shared memory on
  CPU (a file descriptor, passed by multiprocessing's resource sharer) or device memory on GPU (a CUDA
  IPC handle); only a handle of a few hundred bytes travels, through the job's c10d store. Used by the
  ``tensor`` sync (one colocated engine), and on CPU by every engine on the first node: gloo has no
  shared-memory transport (its loopback TCP moved 512 MiB at 2.3-3.9 GB/s here, 2.5-4x a memory copy),
  where NCCL uses NVLink or shared memory within a node by itself.
* ``group``: rank 0 broadcasts each bucket, one collective per bucket, over the weight group; the
  engine's ranks receive it with ``update_weights_from_distributed(load_format="flattened_bucket")``.
  Every engine of the ``broadcast`` sync on GPU (NCCL), and engines on other nodes on CPU (gloo). Rank
  0 then owns every bucket (the others' pieces are sent to it).

The buckets are pipelined: an owner packs bucket k+1 into its second buffer while the engines load
bucket k from the first, and reuses a buffer only after every engine that reads it has loaded it (the
engine hosts say so in the store). A push holds two buffers per owner, of its largest bucket each,
kept from one push to the next. The last bucket carries the new weight version, so the engine serves
it from that bucket on; one cache flush follows the whole push.

Every rank calls :meth:`WeightPush.run`; an engine that fails meanwhile is recorded (its host goes on
marking buckets loaded, so that the owners and the collectives finish) and restarted by the fleet.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.learner.flat_buckets import PlannedBucket, PushPlan, holds_pieces, pack_bucket, send_pieces
from sparse_rl_mega.rollout.engine import EngineFailure, RolloutEngine

STORE_PREFIX = "sparse_rl_mega/weight_push/"


def share_authkey() -> None:
    """Give every rank rank 0's multiprocessing authkey (collective). An engine's scheduler takes a
    buffer's file descriptor from the owning rank's resource sharer, which accepts only processes with
    its own authkey: ranks that torchrun started each have a random one (forked ranks share it already).
    Must run before the engines start (their processes inherit the key)."""
    key = [bytes(multiprocessing.current_process().authkey)]
    dist.broadcast_object_list(key, src=0)
    multiprocessing.current_process().authkey = key[0]


@dataclass
class PushTimes:
    """Seconds this rank spent on each part of a push (summed over buckets; the parts overlap in time)."""
    pack_s: float = 0.0        # writing its buckets (and receiving the pieces other ranks sent)
    send_s: float = 0.0        # sending its pieces to owners, broadcasting buckets to the weight group
    wait_s: float = 0.0        # an owner waiting for a buffer to be free, a host for a bucket to be packed
    load_s: float = 0.0        # a host's engine loading buckets (after the last bucket was handed over)
    session_s: float = 0.0     # a host's begin/end of the engine's weight-update session

    def metrics(self) -> dict[str, float]:
        return {f"time/sync_{k}": v for k, v in vars(self).items()}


@dataclass
class Consumer:
    """An engine a push feeds, as its host knows it."""
    index: int
    host_rank: int
    tp: int
    transport: str  # shared | group
    rank_offset: int = 0  # group: its first member number in the weight group (rank 0 is member 0)


class PushBuffers:
    """An owner's two bucket buffers (uint8), kept across pushes: host shared memory on CPU, device
    memory on GPU; its j-th bucket goes into buffer j % 2. Replaced when a plan needs other sizes."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    def get(self, own: int, sizes: tuple[int, int], device: torch.device, shared: bool) -> torch.Tensor:
        """The buffer of this owner's bucket number ``own``; ``sizes``: ``PushPlan.buffer_bytes``."""
        if [(b.numel(), b.device) for b in self.buffers] != [(n, device) for n in sizes]:
            self.buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
            if shared and device.type == "cpu":  # (a file descriptor an engine can map)
                self.buffers = [b.share_memory_() for b in self.buffers]
        return self.buffers[own % 2]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


def serialize_bucket(flat: torch.Tensor, slots: list, nbytes: int, dtype: torch.dtype, copies: int) -> list[bytes]:
    """SGLang's flattened-bucket payload for the tensors ``slots`` (``flat_buckets.Slot``) packed in the
    first ``nbytes`` of ``flat``, once per engine TP rank (each
    scheduler rank takes one: a file descriptor or CUDA IPC handle is claimed once). The metadata are
    plain namespaces (SGLang reads their attributes; its unpickler allows them), so a learner rank need
    not import SGLang."""
    if flat.is_cuda:  # SGLang's own reduction of CUDA tensors (device UUIDs): its unpickler allows only that one
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        monkey_patch_torch_reductions()
        torch.cuda.current_stream().synchronize()  # the scheduler reads on its own stream
    from multiprocessing.reduction import ForkingPickler

    metadata = [SimpleNamespace(name=s.name, shape=torch.Size(s.shape), dtype=dtype, start_idx=s.offset,
                                end_idx=s.offset + s.nbytes, numel=s.nbytes) for s in slots]
    payload = {"flattened_tensor": flat[:nbytes], "metadata": metadata}
    return [bytes(ForkingPickler.dumps(payload)) for _ in range(copies)]


class WeightPush:
    """One push of ``plan`` (identical on every rank) as weight ``version``. ``engine``: the engine this
    rank hosts, ``my_engine`` its index (None elsewhere; a failed one is skipped); ``consumers``: every
    engine; ``store``: this rank's connection to the job's store (:func:`push_store`), keys under
    ``push_id``; ``timeout_s`` bounds every wait for another rank; ``group_name``: the weight group's
    (engines with the ``group`` transport)."""

    def __init__(self, plan: PushPlan, shards: list, arch, version: int, engine: Optional[RolloutEngine],
                 my_engine: Optional[int], consumers: list[Consumer], buffers: PushBuffers, store, push_id: int,
                 timeout_s: float, group_name: Optional[str] = None):
        self.plan, self.shards, self.arch, self.version = plan, shards, arch, version
        self.engine, self.my_engine, self.consumers = engine, my_engine, consumers
        self.buffers, self.store, self.timeout_s, self.group_name = buffers, store, timeout_s, group_name
        self.prefix = f"{push_id}/"
        self.rank = dist.get_rank()
        self.times = PushTimes()
        self.failure: Optional[EngineFailure] = None
        self.shared = [c for c in consumers if c.transport == "shared"]
        self.grouped = any(c.transport == "group" for c in consumers)
        mine = [c for c in consumers if c.index == my_engine]
        self.me: Optional[Consumer] = mine[0] if mine else None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.weight_group = engine.weight_group if engine is not None and self.grouped else None
        self.group_broken = False
        self._own_flat: Optional[torch.Tensor] = None  # the buffer of the bucket this rank packed last
        self.session = None  # the engine's begin_weight_update, submitted

    # ------------------------------------------------------------------ store keys
    def _key(self, bucket: int, what: str) -> str:
        return f"{self.prefix}b{bucket}/{what}"

    def _wait(self, keys: list[str], why: str) -> None:
        started = time.perf_counter()
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except dist.DistStoreError:
            raise RuntimeError(f"weight push {self.version}: {why} for {self.timeout_s:g} s") from None
        finally:
            self.times.wait_s += time.perf_counter() - started

    # ------------------------------------------------------------------ the push
    def run(self) -> Optional[EngineFailure]:
        """This rank's part of the push; returns this host's engine failure, if any."""
        if self.me is not None:
            self._begin()
        receives: list = []
        if self.me is not None and self.me.transport == "group":  # the engine takes its receives in order
            receives = [self._submit(lambda b=b: self.engine.submit_flat_receive(
                b.slots, self.plan.dtype, self.group_name, self._version_if_last(b))) for b in self.plan.buckets]
        pending: Optional[tuple[int, object]] = None  # the bucket this host's engine is loading
        own = 0  # buckets this rank packed so far
        for bucket in self.plan.buckets:
            if bucket.owner == self.rank:
                self._pack_and_publish(bucket, own)
                own += 1
            elif holds_pieces(bucket, self.rank):
                started = time.perf_counter()
                send_pieces(bucket, self.shards)
                self.times.send_s += time.perf_counter() - started
            if self.me is not None and self.me.transport == "shared":
                payloads = self._take(bucket)
                # queued behind the bucket the engine is loading (another buffer), so that the engine
                # goes on without a round trip to this thread; then that one is marked loaded
                submitted = (bucket.index, self._submit(lambda: self.engine.submit_flat_bucket(
                    payloads, self._version_if_last(bucket))))
                if pending is not None:
                    self._finish(*pending)
                pending = submitted
        if pending is not None:
            self._finish(*pending)
        for received in receives:
            self._finish(None, received)
        if self.me is not None:
            self._end()
        self._collect_loaded(self.plan.owned_by(self.rank)[-2:])
        return self.failure

    def _version_if_last(self, bucket: PlannedBucket) -> Optional[int]:
        return self.version if bucket.index == len(self.plan.buckets) - 1 else None

    # ------------------------------------------------------------------ owner
    def _pack_and_publish(self, bucket: PlannedBucket, own: int) -> None:
        if own >= 2:  # its buffer held the bucket before last: every reader must be done with it
            self._collect_loaded([self.plan.owned_by(self.rank)[own - 2]])
        flat = self.buffers.get(own, self.plan.buffer_bytes(self.rank), self.device, shared=bool(self.shared))
        started = time.perf_counter()
        pack_bucket(self.plan, bucket, flat, self.shards, self.arch)
        self.times.pack_s += time.perf_counter() - started
        for c in self.shared:
            if c.index == self.my_engine:
                continue  # handed to this rank's own engine directly (_take)
            self.store.set(self._key(bucket.index, f"payload{c.index}"),
                           pickle.dumps(serialize_bucket(flat, bucket.slots, bucket.nbytes, self.plan.dtype, c.tp)))
        self._own_flat = flat
        if self.grouped and not self.group_broken:  # rank 0 (it owns every bucket then): one broadcast each
            started = time.perf_counter()
            try:
                dist.broadcast(flat[:bucket.nbytes], src=0, group=self.weight_group)
            except RuntimeError as exc:  # a member left (its engine died) or the group's timeout passed
                self.group_broken = True
                if self.failure is None:  # (blamed on this host's engine: every engine restarts)
                    self.failure = self.engine.broadcast_failed(exc)
            self.times.send_s += time.perf_counter() - started

    def _collect_loaded(self, buckets: list[PlannedBucket]) -> None:
        """Wait until every engine reading shared buffers loaded ``buckets`` (this rank's), and drop the
        store's keys that said so. (A push's last two buckets are waited for at its end: the store keeps
        no key from one push to the next.)"""
        for bucket in buckets:
            keys = [self._key(bucket.index, f"loaded{c.index}") for c in self.shared]
            if keys:
                self._wait(keys, f"the engines did not finish loading bucket {bucket.index}")
            for key in keys:
                self.store.delete_key(key)

    # ------------------------------------------------------------------ engine host
    def _take_key(self, bucket: PlannedBucket) -> str:
        return self._key(bucket.index, f"payload{self.me.index}")

    def _take(self, bucket: PlannedBucket) -> Optional[list[bytes]]:
        """The payloads of ``bucket`` for this host's engine (one per TP rank; None for a failed engine,
        whose host still takes what the owner published for it)."""
        if bucket.owner == self.rank:
            failed = self.failure is not None or self.engine is None
            return None if failed else serialize_bucket(self._own_flat, bucket.slots, bucket.nbytes, self.plan.dtype,
                                                          self.me.tp)
        key = self._take_key(bucket)
        self._wait([key], f"bucket {bucket.index} was not packed by rank {bucket.owner}")
        payloads = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return payloads

    def _loaded(self, bucket: int) -> None:
        if any(c.index == self.me.index for c in self.shared):
            self.store.set(self._key(bucket, f"loaded{self.me.index}"), b"1")

    def _submit(self, call):
        """``call()`` (an engine submission returning a future), or None once this engine failed."""
        if self.failure is not None or self.engine is None:
            return None
        try:
            return call()
        except EngineFailure as exc:
            self.failure = exc
            return None

    def _finish(self, bucket: Optional[int], future) -> None:
        """Wait for a bucket's load; then (shared transport) mark it loaded for its owner."""
        started = time.perf_counter()
        if future is not None and self.failure is None:
            try:
                self.engine.wait_bucket(future)
            except EngineFailure as exc:
                self.failure = exc
        self.times.load_s += time.perf_counter() - started
        if bucket is not None:
            self._loaded(bucket)

    def _begin(self) -> None:
        """Open the engine's session without waiting: the buckets' loads queue behind it."""
        self.session = self._submit(self.engine.submit_begin_update) if self.engine is not None else None

    def _end(self) -> None:
        started = time.perf_counter()
        if self.failure is None and self.engine is not None:
            try:
                self.engine.wait_begin_update(self.session)
                self.engine.end_update(self.version)
            except EngineFailure as exc:
                self.failure = exc
        self.times.session_s += time.perf_counter() - started


def consumers_of(placements, method: str, on_gpu: bool) -> list[Consumer]:
    """Every engine with its transport: ``group`` for the broadcast sync on GPU and, on CPU, for engines
    on another node than rank 0; ``shared`` otherwise. The weight group is rank 0 (member 0) and the TP
    ranks of the ``group`` engines, in engine order."""
    out, members = [], 1
    for p in placements:
        transport = "group" if method == "broadcast" and (on_gpu or p.node != 0) else "shared"
        out.append(Consumer(p.index, p.host_rank, p.tp, transport, members if transport == "group" else 0))
        members += p.tp if transport == "group" else 0
    return out


def weight_group_size(consumers: list[Consumer]) -> int:
    """Members of the weight group (1: no engine receives by broadcast, no group)."""
    return 1 + sum(c.tp for c in consumers if c.transport == "group")


def push_store():
    """This rank's own connection to the job's c10d store, under the pushes' prefix."""
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(STORE_PREFIX + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/",
                            _get_default_store().clone())
