"""Resumable checkpoints with ``megatron.core.dist_checkpointing``.

``<dir>/iter_<NNNNNNN>/`` holds:

* the model and optimizer shards (dist_checkpointing: any TP/PP layout can load them, the optimizer's
  Adam moments included, so a run may resume on a different layout);
* ``sparse_rl_mega.json``: the iteration completed, the world layout, the MLflow run id and the
  resolved config (for the record; the resuming run's own config is what runs);
* ``rng/rank_<R>.pt``: every rank's torch (and CUDA) RNG state, restored only when the layout is the
  same (another layout has other ranks; the loop's sampling seeds derive from the iteration anyway).

A checkpoint is complete once ``sparse_rl_mega.json`` exists (written last); only the newest
``keep_last`` are kept. The data position is the iteration: batch ``k`` is a pure function of the
data seed and ``k`` (``PromptDataset.batch``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # (the launcher finds checkpoints without importing the learner)
    from sparse_rl_mega.learner.model import Learner

MARKER = "sparse_rl_mega.json"


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    layout = {"world_size": dist.get_world_size(),
              "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
              "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size()}
    # named only when used, so checkpoints of plain layouts compare equal to older ones
    vpp, cp = ps.get_virtual_pipeline_model_parallel_world_size() or 1, ps.get_context_parallel_world_size()
    if vpp > 1:
        layout["virtual_pipeline_model_parallel_size"] = vpp
    if cp > 1:
        layout["context_parallel_size"] = cp
    return layout


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _writer_results_in_process() -> None:
    """Megatron's torch_dist writer hands the results of its (forked) writer processes to the save
    through a global queue, by default a queue served by a spawned multiprocessing Manager process
    made at the first save (``filesystem_async._get_write_results_queue``: ~4 CPU-s on these cores per
    rank, and a process that a killed rank leaves behind). It is there for asynchronous saves, whose
    write runs in another process; saves here are synchronous (``dist_checkpointing.save`` runs the
    write in this process, ``AsyncRequest.execute_sync``): one process puts and gets, and an
    in-process queue does."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(learner: Learner, ckpt_dir: str | Path, iteration: int, keep_last: int,
                    extra: Optional[dict] = None, rank0_extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Save after ``iteration`` iterations (every rank calls this). ``extra`` goes into the marker;
    ``rank0_extra(folder)``: rank 0 writes more files into the checkpoint folder (before the marker)."""
    from megatron.core import dist_checkpointing

    _writer_results_in_process()

    root = Path(ckpt_dir)
    target = root / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        if target.exists():  # a partial save from a crashed run, or a rerun of the same iteration
            shutil.rmtree(target)
        target.mkdir(parents=True)  # dist_checkpointing needs an existing, empty folder
    dist.barrier()
    from sparse_rl_mega.learner.weights import chunks_sharded_state_dict

    model_state = chunks_sharded_state_dict(learner.modules)
    state = {"model": model_state, "optimizer": learner.optimizer.sharded_state_dict(model_state)}
    dist_checkpointing.save(state, str(target))
    (target / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), target / "rng" / f"rank_{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        if rank0_extra is not None:
            rank0_extra(target)
        marker = {"iteration": iteration, "layout": _layout(), **(extra or {})}
        (target / MARKER).write_text(json.dumps(marker, indent=1, default=str))
        complete = sorted(p for p in root.glob("iter_*") if (p / MARKER).is_file())
        for old in complete[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return target


def checkpoint_folder(cfg) -> Path:
    """Where a run's checkpoints go: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or Path(cfg.trainer.run_dir) / "checkpoints")


def find_checkpoint(spec: str, default_dir: str | Path) -> Optional[Path]:
    """Resolve ``checkpoint.resume``: ``auto`` -> the newest complete checkpoint under
    ``default_dir`` (None when there is none); otherwise a checkpoint folder (``iter_*``) or a
    folder of checkpoints (its newest complete one). Raises when an explicit path has none."""
    if spec == "auto":
        root = Path(default_dir)
        complete = sorted(p for p in root.glob("iter_*") if (p / MARKER).is_file()) if root.is_dir() else []
        return complete[-1] if complete else None
    path = Path(spec)
    if (path / MARKER).is_file():
        return path
    complete = sorted(p for p in path.glob("iter_*") if (p / MARKER).is_file()) if path.is_dir() else []
    if not complete:
        raise FileNotFoundError(f"checkpoint.resume {spec}: no complete checkpoint there "
                                f"(expected {MARKER} in it or in an iter_* folder under it)")
    return complete[-1]


def read_marker(path: str | Path) -> dict:
    return json.loads((Path(path) / MARKER).read_text())


def load_checkpoint(learner: Learner, path: str | Path) -> dict:
    """Load model and optimizer shards into this rank's learner (every rank calls this; the layout
    may differ from the one that saved) and restore the RNG when the layout is the same. Returns the
    marker (``iteration``, ``layout``, ...)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    marker = read_marker(path)
    from sparse_rl_mega.learner.weights import chunks_sharded_state_dict

    model_state = chunks_sharded_state_dict(learner.modules)
    state = {"model": model_state,
             "optimizer": learner.optimizer.sharded_state_dict(model_state, is_loading=True)}
    loaded = dist_checkpointing.load(state, str(path))
    _load_chunks(learner.modules, loaded["model"])
    learner.optimizer.load_state_dict(loaded["optimizer"])
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if marker.get("layout") == _layout() and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    dist.barrier()
    return marker


def _load_chunks(modules, loaded: dict) -> None:
    from sparse_rl_mega.learner.weights import as_chunks

    chunks = as_chunks(modules)
    if len(chunks) == 1:
        chunks[0].load_state_dict(loaded)
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"chunk{i}"])


def load_model_weights(modules, path: str | Path) -> dict:
    """Load only the model shards of a checkpoint into ``modules`` (this rank's GPTModel chunks, any
    TP/PP/virtual-stage layout; every rank calls this): no optimizer needs to exist, the Adam moments
    are not read. Returns the marker."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    marker = read_marker(path)
    from sparse_rl_mega.learner.weights import chunks_sharded_state_dict

    loaded = dist_checkpointing.load({"model": chunks_sharded_state_dict(modules)}, str(path))
    _load_chunks(modules, loaded["model"])
    dist.barrier()
    return marker
