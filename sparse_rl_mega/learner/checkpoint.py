"""Checkpoints with ``megatron.core.dist_checkpointing``: model and optimizer shards plus the
iteration, saved as ``<dir>/iter_<NNNNNNN>``; only the newest ``keep_last`` are kept."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from sparse_rl_mega.learner.model import Learner


def save_checkpoint(learner: Learner, ckpt_dir: str | Path, iteration: int, keep_last: int) -> Path:
    from megatron.core import dist_checkpointing

    root = Path(ckpt_dir)
    target = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)  # dist_checkpointing needs an existing, empty folder
    dist.barrier()
    model_state = learner.module.sharded_state_dict()
    state = {"model": model_state, "optimizer": learner.optimizer.sharded_state_dict(model_state)}
    dist_checkpointing.save(state, str(target))
    dist.barrier()
    if dist.get_rank() == 0:
        (target / "sparse_rl_mega.json").write_text(json.dumps({"iteration": iteration}))
        for old in sorted(root.glob("iter_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return target
