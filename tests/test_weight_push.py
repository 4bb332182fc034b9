"""The weight push's pieces that need no engine (rollout/weight_push.py): which transport each engine
gets, and how a process maps another rank's shared bucket buffer (the engines' pushes: test_engine_kv,
test_learner's packing, the launches)."""
import multiprocessing
import os
import time
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparse_rl_mega.config import load_config
from sparse_rl_mega.cli.planner import push_buffer_bytes
from sparse_rl_mega.runtime.ports import free_port
from sparse_rl_mega.rollout.placement import engine_placements
from sparse_rl_mega.rollout.weight_push import consumers_of, share_authkey, transport, weight_groups
from tests.conftest import ROOT


def test_each_owner_and_engine_get_their_transport():
    # 2 nodes x 2 ranks, learner PP2 (owners: rank 0 on node 0, rank 2 on node 1), 4 engines x TP 2
    engines = consumers_of(engine_placements(nnodes=2, nproc_per_node=2, num_engines=4, engine_tp=2,
                                             placement="separate"))
    owners = [0, 2]
    # CPU: shared buffers within a node; each owner broadcasts to the other node's engines over its group
    cpu = weight_groups(engines, owners, "broadcast", on_gpu=False, nproc_per_node=2, generation=1)
    assert [(g.owner, g.members, g.size) for g in cpu] == [(0, ((2, 1), (3, 3)), 5), (2, ((0, 1), (1, 3)), 5)]
    assert transport(engines[0], 0, "broadcast", False, 2) == "shared"
    assert transport(engines[0], 2, "broadcast", False, 2) == "group"
    # GPU broadcast: every owner to every engine (NCCL); no stage's tensors go through another stage
    gpu = weight_groups(engines, owners, "broadcast", on_gpu=True, nproc_per_node=2, generation=3)
    assert [(g.owner, g.size, g.offset_of(3)) for g in gpu] == [(0, 9, 7), (2, 9, 7)]
    assert gpu[1].name.endswith("_3_r2") and gpu[0].name != cpu[0].name  # new names each time they form
    one = consumers_of(engine_placements(nnodes=1, nproc_per_node=2, num_engines=1, engine_tp=1,
                                         placement="colocated"))
    assert weight_groups(one, [0, 1], "tensor", on_gpu=True, nproc_per_node=2, generation=1) == []  # CUDA IPC


def test_plan_counts_two_bucket_buffers():
    cfg = load_config(ROOT / "examples" / "cpu_smollm2.yaml", ["trainer.sync_bucket_mb=64"])
    a = cfg.model.arch  # tied embeddings: the embedding (113 MiB in float32) alone, then buckets of 64 MiB
    assert push_buffer_bytes(cfg, 0) == a.vocab_size * a.hidden_size * 4 + 64 * 2**20
    assert push_buffer_bytes(cfg, 1) == 2 * 64 * 2**20  # the last stage: layers, the final norm
    cfg = load_config(ROOT / "examples" / "70b_math.yaml", [])  # PP8, untied, buckets of 1024 MB, bf16
    embedding = cfg.model.arch.vocab_size * cfg.model.arch.hidden_size * 2  # 2.0 GiB: its own bucket
    assert push_buffer_bytes(cfg, 0) == embedding + 2**30 and push_buffer_bytes(cfg, 7) == embedding + 2**30
    assert push_buffer_bytes(cfg, 3) == 2 * 2**30
    cfg = load_config(ROOT / "examples" / "70b_math.yaml", ["parallel.pipeline_model_parallel_size=1",
                                                              "parallel.virtual_pipeline_model_parallel_size=1"])
    assert push_buffer_bytes(cfg, 0) == 2 * embedding  # one stage holds the embedding and the output layer


def _rank(rank: int, port: int, share: bool, results) -> None:
    # as torchrun starts ranks: each an interpreter of its own, with its own random authkey
    multiprocessing.current_process().authkey = os.urandom(32)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if share:
        share_authkey()
    handle = [None]
    if rank == 1:  # an owner's bucket buffer, handed over as the push hands it to an engine
        buffer = torch.arange(8, dtype=torch.float32).share_memory_()
        handle = [bytes(ForkingPickler.dumps(buffer))]
    dist.broadcast_object_list(handle, src=1)
    if rank == 0:
        try:
            results.put(ForkingPickler.loads(handle[0]).tolist())
        except multiprocessing.AuthenticationError as exc:
            results.put(f"AuthenticationError: {exc}")
    dist.barrier()  # the owner keeps its buffer until it was mapped
    dist.destroy_process_group()


@pytest.mark.parametrize("share", [True, False])
def test_a_rank_maps_another_ranks_buffer_once_authkeys_are_shared(share):
    """An engine's scheduler maps a buffer through its owner's resource sharer, which accepts only its
    own authkey; ranks that torchrun started each have a random one until share_authkey()."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(rank, port, share, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    got = results.get(timeout=120)
    for proc in procs:
        proc.join(timeout=60)
    if share:
        assert got == [float(i) for i in range(8)]
    else:
        assert str(got).startswith("AuthenticationError"), got


# ----------------------------------------------------------------------------- a broadcast to a dead engine
class _Work:
    """An asynchronous collective's handle: done after ``done_after_s`` (None: never, as an NCCL
    broadcast to a dead member), then ``wait()`` raises ``error`` if given (gloo: a member left)."""

    def __init__(self, done_after_s, error=None):
        self.started, self.done_after_s, self.error, self.waited = time.monotonic(), done_after_s, error, False

    def is_completed(self):
        return self.done_after_s is not None and time.monotonic() - self.started >= self.done_after_s

    def wait(self):
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)


def test_a_broadcast_is_waited_for_without_blocking_on_it():
    """The owner never blocks in an NCCL collective that a dead engine will not finish (its watchdog
    would end the learner rank): it stops once the engine's host says it failed, or at the push's bound."""
    from sparse_rl_mega.rollout.weight_push import wait_for_work

    work = _Work(0.05)
    assert wait_for_work(work, 5.0, lambda: False) is None and work.waited
    started = time.monotonic()
    failed_at = started + 0.3
    why = wait_for_work(_Work(None), 60.0, lambda: time.monotonic() > failed_at, check_every_s=0.05)
    assert why == "an engine of its group failed" and time.monotonic() - started < 1.0
    started = time.monotonic()
    assert wait_for_work(_Work(None), 0.4, lambda: False) == "no answer from its engines in 0.4 s"
    assert 0.4 <= time.monotonic() - started < 1.5
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_for_work(_Work(0.0, "Connection closed by peer"), 5.0, lambda: False)


def test_weight_groups_keep_the_rank_alive_and_end_when_replaced(monkeypatch):
    """The owner's NCCL weight group is made with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (its watchdog aborts
    the communicator on an error, the process goes on) and the environment restored; its collectives
    time out after twice the push's bound. A broken NCCL group is aborted, a healthy one (the groups
    formed again after a restart) destroyed."""
    from sparse_rl_mega.rollout import weight_push

    seen = []
    monkeypatch.setenv(weight_push.NCCL_ERROR_HANDLING, "3")
    monkeypatch.setattr(weight_push, "init_weight_group",
                        lambda **kw: seen.append((os.environ[weight_push.NCCL_ERROR_HANDLING], kw["timeout"])) or "pg")
    assert weight_push.create_weight_group("127.0.0.1", 1, 2, "g", "nccl", 7.0) == "pg"
    assert seen == [("2", timedelta(seconds=7.0))] and os.environ[weight_push.NCCL_ERROR_HANDLING] == "3"
    assert weight_push.weight_group_timeout_s(660.0) == 1320.0

    ended = []
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setattr(c10d, "_abort_process_group", lambda pg: ended.append(("abort", pg)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda pg: ended.append(("destroy", pg)))
    for backend, broken, want in [("nccl", True, "abort"), ("nccl", False, "destroy"), ("gloo", True, "destroy")]:
        monkeypatch.setattr(dist, "get_backend", lambda pg, backend=backend: backend)
        ended.clear()
        weight_push.end_weight_group(backend, broken)
        assert ended == [(want, backend)], (backend, broken)
