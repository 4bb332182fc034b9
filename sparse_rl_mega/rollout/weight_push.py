"""One weight push from the learner's ranks to every engine, bucket by bucket
(:mod:`sparse_rl_mega.learner.flat_buckets` plans and packs the buckets: each pipeline stage's first
TP rank, its *owner*, packs the stage's own tensors).

A bucket reaches an engine by one of two transports, chosen per owner and engine (:func:`transport`):

* ``shared``: the engine's scheduler reads the bucket from the owner's buffer itself, through SGLang's
  ``update_weights_from_tensor(load_format="flattened_bucket")``: the buffer is host shared memory on
  CPU (a file descriptor, passed by multiprocessing's resource sharer) or device memory on GPU (a CUDA
  IPC handle); only a handle of a few hundred bytes travels, through the job's c10d store. Used by the
  ``tensor`` sync (one colocated engine), and on CPU between an owner and the engines of its node: gloo
  has no shared-memory transport (its loopback TCP moved 512 MiB at 2.3-3.9 GB/s here, 2.5-4x a memory
  copy), where NCCL uses NVLink or shared memory within a node by itself.
* ``group``: the owner broadcasts each of its buckets, one collective per bucket, over a weight group of
  its own (SGLang receives from member 0 of a named group, so each owner is member 0 of one); the
  engine's ranks receive it with ``update_weights_from_distributed(load_format="flattened_bucket")``.
  The ``broadcast`` sync on GPU (NCCL; gloo for colocated engines), and on CPU an owner's buckets into
  the engines of other nodes (gloo). No stage's tensors travel through another stage.

The buckets are pipelined: an owner packs bucket k+1 into its second buffer while the engines load
bucket k from the first, and reuses a buffer only after every engine that reads it has loaded it (the
engine hosts say so in the store; a broadcast is done when it returns). A push holds two buffers per
owner, kept from one push to the next. Every engine takes the buckets in plan order (the owners' in
turn), so no wait can close a circle: bucket k waits only for buckets before it. The last bucket
carries the new weight version, so the engine serves it from that bucket on; one cache flush follows
the whole push.

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
from sparse_rl_mega.rollout.engine import WEIGHT_GROUP, EngineFailure, RolloutEngine
from sparse_rl_mega.rollout.sglang_internals import enable_cuda_tensor_pickling, init_weight_group

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
    send_s: float = 0.0        # sending its pieces to its stage's owner, broadcasting over its weight group
    wait_s: float = 0.0        # an owner waiting for a buffer to be free, a host for a bucket to be packed
    load_s: float = 0.0        # a host waiting for its engine's loads (what packing did not hide)
    session_s: float = 0.0     # a host's begin/end of the engine's weight-update session

    def metrics(self) -> dict[str, float]:
        return {f"time/sync_{k}": v for k, v in vars(self).items()}


@dataclass(frozen=True)
class Consumer:
    """An engine a push feeds."""
    index: int
    tp: int
    node: int


@dataclass(frozen=True)
class WeightGroup:
    """The weight group of one owner: the owner is member 0; ``members``: (engine index, its first
    member number) of the engines that receive this owner's buckets by broadcast."""
    owner: int
    name: str
    members: tuple[tuple[int, int], ...]
    size: int

    def offset_of(self, engine: Optional[int]) -> Optional[int]:
        return next((offset for index, offset in self.members if index == engine), None)


def transport(consumer: Consumer, owner: int, method: str, on_gpu: bool, nproc_per_node: int) -> str:
    """How ``owner``'s buckets reach ``consumer``: ``shared`` for the ``tensor`` sync and, on CPU, within
    a node; ``group`` otherwise (the ``broadcast`` sync on GPU, other nodes on CPU)."""
    if method == "tensor" or (not on_gpu and consumer.node == owner // nproc_per_node):
        return "shared"
    return "group"


def weight_groups(consumers: list[Consumer], owners: list[int], method: str, on_gpu: bool, nproc_per_node: int,
                  generation: int) -> list[WeightGroup]:
    """One group per owner that broadcasts to any engine, its members in engine order."""
    groups = []
    for owner in owners:
        members, size = [], 1
        for c in consumers:
            if transport(c, owner, method, on_gpu, nproc_per_node) == "group":
                members.append((c.index, size))
                size += c.tp
        if members:
            groups.append(WeightGroup(owner, f"{WEIGHT_GROUP}_{generation}_r{owner}", tuple(members), size))
    return groups


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


def serialize_bucket(flat: torch.Tensor, slots: list, nbytes: int, dtype: torch.dtype, copies: int) -> list[bytes]:
    """SGLang's flattened-bucket payload for the tensors ``slots`` (``flat_buckets.Slot``) packed in the
    first ``nbytes`` of ``flat``, once per engine TP rank (each
    scheduler rank takes one: a file descriptor or CUDA IPC handle is claimed once). The metadata are
    plain namespaces (SGLang reads their attributes; its unpickler allows them), so a learner rank need
    not import SGLang."""
    if flat.is_cuda:  # SGLang's own reduction of CUDA tensors (device UUIDs): its unpickler allows only that one
        enable_cuda_tensor_pickling()
        torch.cuda.current_stream().synchronize()  # the scheduler reads on its own stream
    from multiprocessing.reduction import ForkingPickler

    metadata = [SimpleNamespace(name=s.name, shape=torch.Size(s.shape), dtype=dtype, start_idx=s.offset,
                                end_idx=s.offset + s.nbytes, numel=s.nbytes) for s in slots]
    payload = {"flattened_tensor": flat[:nbytes], "metadata": metadata}
    return [bytes(ForkingPickler.dumps(payload)) for _ in range(copies)]


class WeightPush:
    """One push of ``plan`` (identical on every rank) as weight ``version``. ``engine``: the engine this
    rank hosts, ``my_engine`` its index (None elsewhere; a failed one is skipped); ``consumers``: every
    engine; ``transport_of(consumer, owner)``: :func:`transport` for this run; ``groups``: the weight
    groups by owner, ``group_handle``: the process group of the one this rank owns; ``store``: this
    rank's connection to the job's store (:func:`push_store`), keys under ``push_id``; ``timeout_s``
    bounds every wait for another rank."""

    def __init__(self, plan: PushPlan, shards: list, arch, version: int, engine: Optional[RolloutEngine],
                 my_engine: Optional[int], consumers: list[Consumer], transport_of, groups: dict[int, WeightGroup],
                 group_handle, buffers: PushBuffers, store, push_id: int, timeout_s: float):
        self.plan, self.shards, self.arch, self.version = plan, shards, arch, version
        self.engine, self.my_engine, self.consumers = engine, my_engine, consumers
        self.transport_of, self.groups, self.group_handle = transport_of, groups, group_handle
        self.buffers, self.store, self.timeout_s = buffers, store, timeout_s
        self.prefix = f"{push_id}/"
        self.rank = dist.get_rank()
        self.times = PushTimes()
        self.failure: Optional[EngineFailure] = None
        self.me: Optional[Consumer] = next((c for c in consumers if c.index == my_engine), None)
        # the engines reading this rank's buckets from its buffers
        self.readers = [c for c in consumers if self.transport_of(c, self.rank) == "shared"]
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.group_broken = False  # a broadcast over this rank's group failed: no more of them
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
        pending: Optional[tuple[Optional[int], object]] = None  # the bucket this host's engine is loading
        own = 0  # buckets this rank packed so far
        for bucket in self.plan.buckets:
            way = self.transport_of(self.me, bucket.owner) if self.me is not None else None
            submitted = None
            if way == "group":  # asked for before this rank broadcasts it (when it is the owner)
                group = self.groups[bucket.owner].name
                submitted = (None, self._submit(lambda: self.engine.submit_flat_receive(  # (called at once)
                    bucket.slots, self.plan.dtype, group, self._version_if_last(bucket))))  # noqa: B023
            if bucket.owner == self.rank:
                self._pack_and_publish(bucket, own)
                own += 1
            elif holds_pieces(bucket, self.rank):
                started = time.perf_counter()
                send_pieces(bucket, self.shards)
                self.times.send_s += time.perf_counter() - started
            if way == "shared":
                payloads = self._take(bucket)
                submitted = (bucket.index, self._submit(lambda: self.engine.submit_flat_bucket(  # (called at once)
                    payloads, self._version_if_last(bucket))))  # noqa: B023
            if submitted is not None:
                # queued behind the bucket the engine is loading, so that the engine goes on without a
                # round trip to this thread; then that one is done (and marked loaded for its owner)
                if pending is not None:
                    self._finish(*pending)
                pending = submitted
        if pending is not None:
            self._finish(*pending)
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
        flat = self.buffers.get(own, self.plan.buffer_bytes(self.rank), self.device, shared=bool(self.readers))
        started = time.perf_counter()
        pack_bucket(self.plan, bucket, flat, self.shards, self.arch)
        if flat.is_cuda:  # the copies were only enqueued: time them done
            torch.cuda.current_stream().synchronize()
        self.times.pack_s += time.perf_counter() - started
        self._own_flat = flat
        for c in self.readers:
            if c.index == self.my_engine:
                continue  # handed to this rank's own engine directly (_take)
            self.store.set(self._key(bucket.index, f"payload{c.index}"),
                           pickle.dumps(serialize_bucket(flat, bucket.slots, bucket.nbytes, self.plan.dtype, c.tp)))
        if self.group_handle is not None and not self.group_broken:  # one broadcast per bucket
            started = time.perf_counter()
            try:
                work = dist.broadcast(flat[:bucket.nbytes], src=0, group=self.group_handle, async_op=True)
                why = wait_for_work(work, self.timeout_s, self._a_member_failed)
            except RuntimeError as exc:  # (gloo: a member left, its engine died)
                why = str(exc).splitlines()[0]
            if why is not None:  # its engines' hosts report their failure; the fleet restarts them
                self.group_broken = True
                print(f"[engine] rank {self.rank}'s weight broadcast failed: {why}; its group is aborted", flush=True)
                end_weight_group(self.group_handle, broken=True)
            self.times.send_s += time.perf_counter() - started

    def _a_member_failed(self) -> bool:
        """Whether the host of an engine in this rank's weight group said that its engine failed."""
        group = self.groups.get(self.rank)
        keys = [self._failed_key(index) for index, _ in group.members] if group is not None else []
        return bool(keys) and any(self.store.check([key]) for key in keys)

    def _failed_key(self, engine: int) -> str:
        return f"{self.prefix}failed{engine}"

    def _record_failure(self, exc: EngineFailure) -> None:
        """This host's engine failed: recorded, and said in the store (an owner broadcasting to it stops
        waiting for it)."""
        self.failure = exc
        if self.me is not None:
            self.store.set(self._failed_key(self.me.index), b"1")

    def _collect_loaded(self, buckets: list[PlannedBucket]) -> None:
        """Wait until every engine reading this rank's buffers loaded ``buckets`` (this rank's), and drop
        the store's keys that said so. (A push's last two buckets are waited for at its end: the store
        keeps no key from one push to the next.)"""
        for bucket in buckets:
            keys = [self._key(bucket.index, f"loaded{c.index}") for c in self.readers]
            if keys:
                self._wait(keys, f"the engines did not finish loading bucket {bucket.index}")
            for key in keys:
                self.store.delete_key(key)

    # ------------------------------------------------------------------ engine host
    def _take(self, bucket: PlannedBucket) -> Optional[list[bytes]]:
        """The payloads of ``bucket`` for this host's engine (one per TP rank; None for a failed engine,
        whose host still takes what the owner published for it)."""
        if bucket.owner == self.rank:
            if self.failure is not None or self.engine is None:
                return None
            return serialize_bucket(self._own_flat, bucket.slots, bucket.nbytes, self.plan.dtype, self.me.tp)
        key = self._key(bucket.index, f"payload{self.me.index}")
        self._wait([key], f"bucket {bucket.index} was not packed by rank {bucket.owner}")
        payloads = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return payloads

    def _submit(self, call):
        """``call()`` (an engine submission returning a future), or None once this engine failed."""
        if self.failure is not None or self.engine is None:
            return None
        try:
            return call()
        except EngineFailure as exc:
            self._record_failure(exc)
            return None

    def _finish(self, bucket: Optional[int], future) -> None:
        """Wait for a bucket's load; then (``bucket`` given: it came from a shared buffer) tell its owner."""
        started = time.perf_counter()
        if future is not None and self.failure is None:
            try:
                self.engine.wait_bucket(future)
            except EngineFailure as exc:
                self._record_failure(exc)
        self.times.load_s += time.perf_counter() - started
        if bucket is not None:
            self.store.set(self._key(bucket, f"loaded{self.me.index}"), b"1")

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
                self._record_failure(exc)
        self.times.session_s += time.perf_counter() - started


def wait_for_work(work, bound_s: float, failed, poll_s: float = 0.002, check_every_s: float = 0.25
                  ) -> Optional[str]:
    """Wait for an asynchronous collective ``work`` without blocking the host on it: None once it is done
    (``work.wait()`` then raises what a gloo collective raised); else why not, when ``failed()`` (asked
    every ``check_every_s``) says a member's engine failed or ``bound_s`` passed. A blocking NCCL
    collective would wait for a dead member until the group's watchdog, whose default handling
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) ends this process: a recoverable engine failure would end
    the learner rank."""
    started = time.monotonic()
    checked = started
    while not work.is_completed():
        now = time.monotonic()
        if now - checked >= check_every_s:
            checked = now
            if failed():
                return "an engine of its group failed"
        if now - started > bound_s:
            return f"no answer from its engines in {bound_s:g} s"
        time.sleep(poll_s)
    work.wait()
    return None


def weight_group_timeout_s(push_timeout_s: float) -> float:
    """The owner's side of a weight group times its collectives out after this: twice a push's own bound
    on a broadcast, so that the push gives up (and aborts the group) first."""
    return 2 * push_timeout_s


def create_weight_group(host: str, port: int, size: int, name: str, backend: str, timeout_s: float):
    """This rank's side of a weight group, as its member 0 (it hosts the group's store at ``port``);
    returns once every member joined. Its collectives time out after ``timeout_s``. An NCCL group is
    made with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (read when ProcessGroupNCCL is constructed): on a
    member's error or the timeout its watchdog aborts the communicator and leaves this process running
    (the default, 3, ends the process)."""
    saved = os.environ.get(NCCL_ERROR_HANDLING)
    os.environ[NCCL_ERROR_HANDLING] = WEIGHT_GROUP_ERROR_HANDLING
    try:
        return init_weight_group(backend=backend, init_method=f"tcp://{host}:{port}", world_size=size, rank=0,
                                 group_name=name, timeout=timedelta(seconds=timeout_s))
    finally:
        if saved is None:
            os.environ.pop(NCCL_ERROR_HANDLING)
        else:
            os.environ[NCCL_ERROR_HANDLING] = saved


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
WEIGHT_GROUP_ERROR_HANDLING = "2"  # CleanUpOnly: abort the communicator, keep the process


def end_weight_group(handle, broken: bool) -> None:
    """End this rank's side of a weight group: a broken one is aborted (an NCCL broadcast to a dead
    member may still occupy the GPU), a healthy one destroyed (when the groups are formed again)."""
    if broken and dist.get_backend(handle) == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(handle)  # (also deregisters it)
    else:
        dist.destroy_process_group(handle)


def consumers_of(placements) -> list[Consumer]:
    return [Consumer(p.index, p.tp, p.node) for p in placements]


def push_store():
    """This rank's own connection to the job's c10d store, under the pushes' prefix."""
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(STORE_PREFIX + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/",
                            _get_default_store().clone())
