"""Every rank's handle on the job's rollout engines: which engine this rank hosts and its supervised
start, the weight push from the learner to every engine with its check, and recovery.

Recovery: an engine call that fails raises ``EngineFailure`` on its host (``rollout/engine.py``); at
the end of the phase every rank learns which engines failed (one collective,
``supervisor.agree_on_failures``), the failed engines are restarted (every engine with the broadcast
sync: they share the owners' weight groups), all ranks push them the current weights (same version; checked
by version and dense logprobs as after every push), and the failed work is done again: a rollout
shard with the same prompt-indexed seeds, so the batch is the one an uninterrupted run gets.
Every method here is a collective (all ranks call it) unless it says otherwise.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from typing import Optional, TypeVar
from collections.abc import Callable

import torch
import torch.distributed as dist

from sparse_rl_mega.batch import RolloutBatch
from sparse_rl_mega.learner.flat_buckets import plan_push
from sparse_rl_mega.learner.step import forward_logprobs
from sparse_rl_mega.learner.weights import _local_shards
from sparse_rl_mega.rollout.engine import EngineFailure, RolloutEngine
from sparse_rl_mega.rollout.engine_processes import keep_process_on_child_crash, without_launcher_env
from sparse_rl_mega.rollout.placement import run_placements
from sparse_rl_mega.rollout.supervisor import (EnginesGaveUp, EngineStart, EngineSupervisor, agree_on_errors,
                                               agree_on_failures, gather_given)
from sparse_rl_mega.rollout.weight_push import (PushBuffers, WeightGroup, WeightPush, consumers_of, create_weight_group,
                                                end_weight_group, push_store, share_authkey, transport,
                                                weight_group_timeout_s, weight_groups)
from sparse_rl_mega.runtime.ports import free_port


T = TypeVar("T")
CHECK_PHASE = "weight sync (logprob check)"


class EngineFleet:
    def __init__(self, cfg, rank: int, faults, log=print):
        r = cfg.rollout
        self.cfg, self.rank, self.faults, self.log = cfg, rank, faults, log
        self.placements = run_placements(cfg)
        mine = [e for e in self.placements if e.host_rank == rank]
        self.placement = mine[0] if mine else None  # the engine this rank hosts
        # colocated engines on GPU give their memory back while the learner trains
        self.release_memory = torch.cuda.is_available() and r.placement == "colocated"
        self.released = False  # this host's engine gave its memory to the learner
        self.supervisor: Optional[EngineSupervisor] = None
        self.learner = None  # set by ready(): the weights come from its modules
        self.restarts = 0  # engine restarts since reset by the trainer (every iteration)
        self.groups = 0  # times the weight groups were formed (again after engines restart, new names)
        self.weight_groups: dict[int, WeightGroup] = {}  # by owner: its group's name and members
        self.group_handle = None  # the process group of the weight group this rank owns
        self.version = 0  # the weights every engine serves: those after this many iterations
        self.check_ids: Optional[list[int]] = None  # checks a restarted engine's weights (ready())
        # how each engine gets weights (weight_push.py); the plan, buffers and store of the pushes
        self.consumers = consumers_of(self.placements)
        self.push_buffers = PushBuffers()
        self.pushes = 0
        self._plan = None  # (its key, PushPlan): the buckets depend only on the layout and the settings
        self._shards = None  # (learner, its main-replica shards)
        self._store = None
        share_authkey()  # before any engine starts (collective)

    @property
    def engine(self) -> Optional[RolloutEngine]:
        return self.supervisor.engine if self.supervisor is not None else None

    # ------------------------------------------------------------------ start
    def start(self, make_start: Callable[[str], EngineStart]) -> None:
        """Engine hosts only: start the engine in the background (``make_start(name)``)."""
        r = self.cfg.rollout
        keep_process_on_child_crash()  # an engine child's crash must not end this learner rank
        self.supervisor = EngineSupervisor(self.placement.index, make_start, max_restarts=r.max_engine_restarts,
                                           start_timeout_s=r.startup_timeout_s)
        self.supervisor.start()

    def ready(self, learner, check_ids: Optional[list[int]]) -> Optional[float]:
        """Wait for this host's engine and form the weight group; ``check_ids`` (rank 0's, shared with
        all): the sequence that checks a restarted engine. Returns the engine's start seconds (hosts)."""
        self.learner = learner
        seconds = None
        if self.supervisor is not None and self.supervisor.starting is not None:
            self.supervisor.ready()
            seconds = self.supervisor.start_seconds
        shared = [check_ids]
        dist.broadcast_object_list(shared, src=0)
        self.check_ids = shared[0]
        self.form_weight_group()
        return seconds

    def transport_of(self, consumer, owner: int) -> str:
        """How ``owner``'s buckets reach engine ``consumer`` in this run (``weight_push.transport``)."""
        cfg = self.cfg
        return transport(consumer, owner, cfg.trainer.sync_method, torch.cuda.is_available(),
                         cfg.parallel.nproc_per_node)

    def form_weight_group(self) -> None:
        """Every rank that owns buckets and broadcasts them to some engine forms a weight group with
        those engines' ranks, as its member 0 (``weight_push.weight_groups``); again after engines
        restart, under new names. Each group is formed by all ranks in turn (its owner says where)."""
        cfg = self.cfg
        if self.group_handle is not None:  # this rank's group of the engines before a restart
            end_weight_group(self.group_handle, broken=False)
            self.log(f"[setup] weight broadcast group {self.weight_groups[self.rank].name} ended")
        self.group_handle = None
        self.groups += 1
        self.weight_groups = {g.owner: g for g in weight_groups(
            self.consumers, self.owners(), cfg.trainer.sync_method, torch.cuda.is_available(),
            cfg.parallel.nproc_per_node, self.groups)}
        # NCCL refuses two members on one GPU: a colocated engine shares a learner rank's GPU, so
        # colocated engines receive over gloo (staged through host memory); separate engines over NCCL
        backend = "nccl" if torch.cuda.is_available() and cfg.rollout.placement == "separate" else "gloo"
        for owner, group in self.weight_groups.items():
            address = [None]
            if self.rank == owner:  # the owner hosts the group's store
                address = [(_address_for_others(cfg, self.rank), free_port())]
            dist.broadcast_object_list(address, src=owner)
            host, port = address[0]
            offset = group.offset_of(self.placement.index if self.placement is not None else None)
            joining = None
            if offset is not None:  # this rank's engine joins (on its call thread: the owner's half blocks)
                joining = self.engine.submit_join_weight_group(host, port, offset, group.size, backend, group.name)
            if self.rank == owner:
                with without_launcher_env():
                    self.group_handle = create_weight_group(host, port, group.size, group.name, backend,
                                                            weight_group_timeout_s(self.push_timeout_s))
            if joining is not None:
                self.engine.wait_join_weight_group(joining)
            self.log(f"[setup] weight broadcast group of {group.size} members: rank {owner}'s ({backend}, "
                     f"{host}:{port})")

    def owners(self) -> list[int]:
        """The ranks that own buckets (the first TP rank of every pipeline stage), from the plan."""
        return self._push_plan().owners

    # ------------------------------------------------------------------ work on the engines
    def run_on_engines(self, work: Callable[[RolloutEngine], T], version: int) -> Optional[T]:
        """Hosts: ``work(engine)`` (their rollout shard), then a colocated GPU engine releases its memory
        for the learner's training. A failed engine is restarted with weights ``version`` and runs
        ``work`` again; the others keep their result. Returns this host's result (None elsewhere)."""
        result, done = None, False
        while True:
            failure = None
            if self.placement is not None:
                try:
                    if not done:
                        result, done = work(self.engine), True
                    if self.release_memory and not self.released:
                        self.engine.release_memory()
                        self.released = True
                except EngineFailure as exc:
                    failure = exc
            failed = self._agree(failure)
            if not failed:
                return result
            self.recover(failed, version)

    def push_weights(self, probe_ids: Optional[list[int]], version: int, timer=None,
                     check_before: bool = True) -> dict[str, float]:
        """Push the learner's shards to every engine as HF tensors, streamed layer by layer into buckets
        (every rank takes part: the pieces travel to rank 0, which pushes them to its engine in-process
        or broadcasts them to all engines), as weight ``version``. With ``probe_ids`` every engine's
        dense logprobs of that sequence are compared with the learner's after the push (and, with
        ``check_before``, before it). ``timer``: a PhaseTimer, the push is its ``sync`` phase. An
        engine that fails meanwhile is restarted and given the weights. With partial rollouts
        (``rollout.partial``) an engine with generations in flight pauses them for the push and
        resumes them after it (``RolloutEngine.pause``, with the KV choice); the check's probe would
        run beside them."""
        metrics, failure = self._push_once(probe_ids, version, timer, check_before)
        failed = self._agree(failure)
        if failed:  # the restarted engines' push: its metrics, with this engine state's check before the push
            before = {k: v for k, v in metrics.items() if k.startswith("sync/pre_sync")}
            return {**self.recover(failed, version, probe_ids), **before}
        self.version = version
        return metrics

    def _push_once(self, probe_ids, version: int, timer, check_before: bool):
        """One push: ``(metrics, this host's EngineFailure or None)``. A host whose engine fails goes on
        taking part (marking buckets loaded, sending its pieces), so that every rank's waits and
        collectives finish."""
        metrics: dict[str, float] = {}
        failure: Optional[EngineFailure] = None
        check = probe_ids is not None
        learner_logp = self.learner_logprobs(probe_ids) if check else None  # every rank takes part
        host = self.engine is not None
        before, paused, partial = None, 0, self.cfg.rollout.partial
        try:
            if host and self.released:  # a colocated GPU engine takes its memory back first
                self.engine.resume_memory()
                self.released = False
            # (released weights come back undefined until the push: nothing to compare before it)
            if check and check_before and host and not self.release_memory:
                before = _max_abs_diff(self.engine.dense_logprobs(probe_ids, phase=CHECK_PHASE), learner_logp)
            if host and partial != "none":  # the requests in flight wait for the new weights
                paused = self.engine.pause(partial)
        except EngineFailure as exc:
            failure = exc
        if check and check_before and not self.release_memory:
            metrics["sync/pre_sync_max_abs_logprob_diff"] = self.max_over_engines(before)
        with timer.phase("sync") if timer is not None else nullcontext():
            started = time.perf_counter()
            push = self._weight_push(version)
            metrics["time/sync_plan_s"] = time.perf_counter() - started
            self.faults.at("push", version - 1)
            started = time.perf_counter()
            failure = push.run() or failure
            if push.group_broken:  # (aborted by the push; formed again when the engines restart)
                self.group_handle = None
            try:
                if host and failure is None:
                    served = self.engine.served_weight_version()
                    if served != str(version):
                        raise RuntimeError(f"after the weight sync engine {self.placement.index} serves version "
                                           f"{served}, expected {version}")
                    self.engine.resume()  # (nothing paused: nothing to do)
            except EngineFailure as exc:
                failure = exc
            metrics.update(push.times.metrics())
            metrics["time/sync_push_s"] = time.perf_counter() - started
            metrics["sync/bytes"] = float(push.plan.nbytes)
            metrics["sync/tensors"] = float(push.plan.tensors)
            metrics["sync/buckets"] = float(len(push.plan.buckets))
            metrics["sync/weight_version"] = float(version)
            if partial != "none":  # the generations paused across this push, on the engine with the most
                metrics["sync/paused_generations"] = self.max_over_engines(float(paused) if host else None)
        if check:
            started = time.perf_counter()
            after = None
            try:
                if host and failure is None:
                    after = _max_abs_diff(self.engine.dense_logprobs(probe_ids, phase=CHECK_PHASE), learner_logp)
                    self.engine.flush_cache()  # the probe's prefix must not serve the next rollout
            except EngineFailure as exc:
                failure = exc
            metrics["sync/max_abs_logprob_diff"] = self.max_over_engines(after)
            metrics["time/sync_check_s"] = time.perf_counter() - started
        return metrics, failure

    def _push_plan(self):
        """The buckets of a push (made once per layout and settings; collective the first time)."""
        cfg = self.cfg
        dtype = torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16
        bucket_bytes = int(cfg.trainer.sync_bucket_mb * 2**20)
        if self._shards is None or self._shards[0] is not self.learner:
            # views of the learner's parameters, which Megatron updates in place (optimizer steps,
            # checkpoint loads): taken once, as the plan
            self._shards = (self.learner, _local_shards(self.learner.modules, main_replica_only=True))
        key = (dtype, bucket_bytes)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, plan_push(self._shards[1], cfg.model.arch, dtype, bucket_bytes))
        return self._plan[1]

    def _weight_push(self, version: int) -> WeightPush:
        """A push of the learner's current weights as ``version``."""
        plan = self._push_plan()
        if self._store is None:
            self._store = push_store()
        self.pushes += 1
        return WeightPush(plan, self._shards[1], self.cfg.model.arch, version, self.engine,
                          self.placement.index if self.placement is not None else None, self.consumers,
                          self.transport_of, self.weight_groups, self.group_handle, self.push_buffers, self._store,
                          self.pushes, timeout_s=self.push_timeout_s)

    @property
    def push_timeout_s(self) -> float:
        """A push's bound on every wait for another rank or engine (a broadcast included)."""
        return self.cfg.rollout.engine_timeout_s + 60

    def recover(self, failed: list, version: int, probe_ids: Optional[list[int]] = None) -> dict[str, float]:
        """Restart the engines in ``failed`` (every engine with the broadcast sync) and push them weights
        ``version``, checked on ``probe_ids`` (default: the first training prompt). Past
        ``rollout.max_engine_restarts`` every rank raises :class:`EnginesGaveUp` naming engine and phase."""
        broadcast = self.cfg.trainer.sync_method == "broadcast"
        for f in failed:
            self.log(f"[engine] {f.line()}; restarting {'every engine (they share the weight groups)' if broadcast else 'it'}")
        self.restarts += len(failed)
        started = time.perf_counter()
        error = None
        if self.placement is not None and (broadcast or self.placement.index in {f.index for f in failed}):
            why = next((f.line() for f in failed if f.index == self.placement.index), "another engine failed")
            try:
                self.supervisor.restart(why)
                self.released = False
            except Exception as exc:  # noqa: BLE001 (every rank stops below, with this line)
                error = str(exc) if isinstance(exc, EnginesGaveUp) else \
                    f"engine {self.placement.index}: restart failed: {exc}"
        errors = agree_on_errors(error)
        if errors:
            raise EnginesGaveUp(errors[0])
        self.form_weight_group()
        metrics = self.push_weights(probe_ids or self.check_ids, version, check_before=False)
        which = "every engine" if broadcast else ", ".join(f"engine {f.index}" for f in failed)
        self.log(f"[engine] {which} restarted and given weights version {version} in "
                 f"{time.perf_counter() - started:.1f} s (logprob difference from the learner "
                 f"{metrics.get('sync/max_abs_logprob_diff', float('nan')):.1e}"
                 f"{'; ' + self.engine.started if self.engine is not None else ''})")
        return metrics

    # ------------------------------------------------------------------ helpers
    def _agree(self, failure: Optional[EngineFailure]) -> list:
        """Every rank's list of the engines that failed in this phase (this host's ``failure`` included)."""
        return agree_on_failures(failure, self.placement.index if self.placement else None)

    def max_over_engines(self, value: Optional[float]) -> float:
        """The largest of the engine hosts' values; NaN when no engine gave one."""
        return max(gather_given(value), default=float("nan"))

    def learner_logprobs(self, probe_ids: list[int]) -> list[float]:
        """The learner's dense logprobs of ``probe_ids[1:]`` at temperature 1 over the whole vocabulary,
        as the engine's greedy prefill (``dense_logprobs``) computes them: the weight check compares
        weights, not sampling settings."""
        ids = torch.tensor([probe_ids])
        one = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=torch.ones(1, ids.shape[1] - 1),
                           logp_sparse=torch.zeros(1, ids.shape[1] - 1), rewards=torch.zeros(1),
                           group_ids=torch.zeros(1, dtype=torch.long))
        return forward_logprobs(self.learner.chunks, one, 1)[0].tolist()

    def close(self, wait_s: float) -> None:
        """This rank only: shut its engine down (one still starting is waited for up to ``wait_s``)."""
        if self.supervisor is not None:
            self.supervisor.close(wait_s)
            self.supervisor = None


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise RuntimeError(f"logprob lengths differ: engine {len(a)} vs learner {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


def _address_for_others(cfg, rank: int) -> str:
    """Where the other members reach a group store that ``rank`` hosts: loopback on one node; else the
    launcher's master address for rank 0 (on the first node) and this host's name for the others (as
    torchrun's rendezvous names a node)."""
    import socket

    if cfg.parallel.nnodes == 1:
        return "127.0.0.1"
    return os.environ.get("MASTER_ADDR", "127.0.0.1") if rank == 0 else socket.getfqdn()
