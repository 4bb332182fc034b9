"""HF-named tensors pushed straight into one engine, for the engine tests: each bucket packed into one
flattened buffer that the engine's ranks map from this process's shared memory (CUDA IPC for GPU
tensors), or broadcast over a weight group this process forms as its member 0. The learner's pushes go
through ``sparse_rl_mega/rollout/fleet.py`` and ``weight_push.py`` instead."""
from __future__ import annotations

from typing import Optional
from collections.abc import Iterable

import torch
import torch.distributed as dist

from sparse_rl_mega.learner.flat_buckets import Slot
from sparse_rl_mega.rollout.engine import WEIGHT_GROUP, EngineFailure, RolloutEngine
from sparse_rl_mega.rollout.engine_processes import without_launcher_env
from sparse_rl_mega.rollout.weight_push import create_weight_group, serialize_bucket

NamedBuckets = Iterable[list[tuple[str, torch.Tensor]]]


class DirectPush:
    """Pushes into ``engine``; :meth:`connect` first for :meth:`broadcast`."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.group, self.backend, self.group_name = engine, None, "gloo", WEIGHT_GROUP

    def connect(self, master_address: str, master_port: int, backend: str = "gloo",
                world_size: Optional[int] = None, group_name: str = WEIGHT_GROUP) -> None:
        """Form a weight group as its member 0, the engine's ranks as members 1..tp (``world_size`` > 1 +
        tp when other engines join too)."""
        world_size = world_size or 1 + self.engine.tp_size
        joining = self.engine.submit_join_weight_group(master_address, master_port, 1, world_size, backend,
                                                       group_name)
        with without_launcher_env():
            self.group = create_weight_group(master_address, master_port, world_size, group_name, backend,
                                             self.engine.timeout_s)
        self.engine.wait_join_weight_group(joining)
        self.backend, self.group_name = backend, group_name

    def shared(self, buckets: NamedBuckets, version: Optional[int] = None) -> int:
        """Load the buckets from shared memory; ``version`` (default: one more than the last) is served after."""
        return self._push(buckets, version, broadcast=False)

    def broadcast(self, buckets: NamedBuckets, version: Optional[int] = None) -> int:
        """As :meth:`shared`, each bucket broadcast over the group of :meth:`connect`."""
        if self.group is None:
            raise RuntimeError("connect() first")
        return self._push(buckets, version, broadcast=True)

    def _push(self, buckets: NamedBuckets, version: Optional[int], broadcast: bool) -> int:
        engine = self.engine
        version = engine.weight_version + 1 if version is None else version
        pending = list(buckets)
        engine.begin_update()
        try:
            for number, named in enumerate(pending):
                dtype, slots, offset = named[0][1].dtype, [], 0
                for name, tensor in named:
                    slots.append(Slot(name, tuple(tensor.shape), offset, tensor.numel() * dtype.itemsize))
                    offset += slots[-1].nbytes
                flat = torch.cat([t.to(dtype).reshape(-1).view(torch.uint8) for _, t in named])
                last = version if number == len(pending) - 1 else None
                if broadcast:
                    submitted = engine.submit_flat_receive(slots, dtype, self.group_name, last)
                    try:
                        dist.broadcast(flat.cuda() if self.backend == "nccl" else flat, src=0, group=self.group)
                    except RuntimeError as exc:
                        raise engine.broadcast_failed(exc) from None
                else:
                    submitted = engine.submit_flat_bucket(
                        serialize_bucket(flat.share_memory_(), slots, offset, dtype, engine.tp_size), last)
                engine.wait_bucket(submitted)
        except EngineFailure:
            raise
        except BaseException:
            engine.end_update(engine.weight_version)  # (the session must not stay open; the version stays)
            raise
        engine.end_update(version)
        return version
