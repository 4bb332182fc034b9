"""Where the rollout engines run and which learner rank drives each one.

Engines are spread evenly over the nodes (``rollout.num_engines / parallel.nnodes`` per node); an
engine's TP group stays within its node. Every engine is driven (started, fed prompts, given
weights) by one learner process on its node, its *host*:

* ``colocated``: engine j of a node uses the node's devices ``j*tp .. j*tp+tp-1``, the same devices
  as the learner ranks with those local ranks; its host is the first of them. On GPU the engine
  releases its memory while the learner trains.
* ``separate``: engine j uses devices after the learner's, ``nproc_per_node + j*tp ..``, so a node
  needs ``nproc_per_node + engines_per_node * tp`` GPUs; its host is local rank j.

How weights reach each engine (shared buffers or a broadcast group): ``rollout/weight_push.py``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnginePlacement:
    index: int          # engine number, 0 .. num_engines-1; prompts are sharded in this order
    node: int
    host_rank: int      # global rank of the learner process that drives it
    first_device: int   # local device index of its TP rank 0 (GPU id on its node)
    tp: int


def engine_placements(nnodes: int, nproc_per_node: int, num_engines: int, engine_tp: int,
                      placement: str) -> list[EnginePlacement]:
    """One :class:`EnginePlacement` per engine (the config validation guarantees the division)."""
    per_node = num_engines // nnodes
    out = []
    for index in range(num_engines):
        node, j = divmod(index, per_node)
        if placement == "colocated":
            local_host, first_device = j * engine_tp, j * engine_tp
        else:
            local_host, first_device = j, nproc_per_node + j * engine_tp
        out.append(EnginePlacement(index=index, node=node, host_rank=node * nproc_per_node + local_host,
                                   first_device=first_device, tp=engine_tp))
    return out


def prompt_shard(num_prompts: int, num_engines: int, index: int) -> range:
    """The prompts of an iteration that engine ``index`` samples (contiguous, equal shares)."""
    share = num_prompts // num_engines
    return range(index * share, (index + 1) * share)


def run_placements(cfg) -> list[EnginePlacement]:
    """The engines of the run configured by ``cfg`` (:func:`engine_placements` of its sections)."""
    r, p = cfg.rollout, cfg.parallel
    return engine_placements(p.nnodes, p.nproc_per_node, r.num_engines, r.engine_tensor_parallel_size, r.placement)


def hosts_an_engine(cfg, rank: int) -> bool:
    """Whether learner rank ``rank`` drives an engine of the run configured by ``cfg``."""
    return any(e.host_rank == rank for e in run_placements(cfg))
