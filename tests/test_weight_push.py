"""The weight push's pieces that need no engine (rollout/weight_push.py): which transport each engine
gets, and how a process maps another rank's shared bucket buffer (the engines' pushes: test_engine_kv,
test_learner's packing, the launches)."""
import multiprocessing
import os
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparse_rl_mega.config import load_config
from sparse_rl_mega.planner import push_buffer_bytes
from sparse_rl_mega.ports import free_port
from sparse_rl_mega.rollout.placement import engine_placements
from sparse_rl_mega.rollout.weight_push import consumers_of, share_authkey, weight_group_size
from tests.conftest import ROOT


def test_each_engine_gets_its_transport():
    two_nodes = engine_placements(nnodes=2, nproc_per_node=2, num_engines=4, engine_tp=2, placement="separate")
    # CPU: engines on rank 0's node read shared buffers, the others join the group after rank 0
    cpu = consumers_of(two_nodes, "broadcast", on_gpu=False)
    assert [c.transport for c in cpu] == ["shared", "shared", "group", "group"]
    assert [c.rank_offset for c in cpu if c.transport == "group"] == [1, 3] and weight_group_size(cpu) == 5
    gpu = consumers_of(two_nodes, "broadcast", on_gpu=True)  # NCCL carries every engine's buckets
    assert [c.rank_offset for c in gpu] == [1, 3, 5, 7] and weight_group_size(gpu) == 9
    one = engine_placements(nnodes=1, nproc_per_node=2, num_engines=1, engine_tp=1, placement="colocated")
    assert [c.transport for c in consumers_of(one, "tensor", on_gpu=True)] == ["shared"]
    assert weight_group_size(consumers_of(one, "tensor", on_gpu=False)) == 1  # no group at all


def test_plan_counts_two_bucket_buffers():
    cfg = load_config(ROOT / "examples" / "cpu_smollm2.yaml", ["trainer.sync_bucket_mb=64"])
    a = cfg.model.arch  # tied embeddings: the embedding (113 MiB in float32) alone, then buckets of 64 MiB
    assert push_buffer_bytes(cfg, 0) == a.vocab_size * a.hidden_size * 4 + 64 * 2**20
    cfg = load_config(ROOT / "examples" / "70b_math.yaml", [])  # broadcast: rank 0 packs every bucket
    embedding = cfg.model.arch.vocab_size * cfg.model.arch.hidden_size * 2
    assert push_buffer_bytes(cfg, 0) == 2 * embedding and push_buffer_bytes(cfg, 1) == 0


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
