"""Resumable checkpoints with ``megatron.core.dist_checkpointing``.

``<dir>/iter_<NNNNNNN>/`` holds:

* the model and optimizer shards (dist_checkpointing: any TP/PP layout can load them, the optimizer's
  Adam moments included, so a run may resume on a different layout);
* ``sparse_rl_mega.json``: the iteration completed, the world layout, the MLflow run id, the resolved
  config and its digest (for the record; the resuming run's own config is what runs), and every other
  file's size and XXH3-64 digest (``files``);
* ``rng/rank_<R>.pt``: every rank's torch (and CUDA) RNG state, restored only when the layout is the
  same (another layout has other ranks; the loop's sampling seeds derive from the iteration anyway).

A checkpoint is complete once ``sparse_rl_mega.json`` exists (written last); resuming verifies every
file against it first (:func:`verify`: sizes, then XXH3-64 digest of the bytes, the files shared among the
ranks) and skips one that fails. After a save the newest ``keep_last`` are kept: the one just saved and
the newest older ones (newer ones are what a run resumed from an older checkpoint abandoned). A write
that fails (no space, permission, quota, I/O) stops the job with one line (:class:`CheckpointNotSaved`)
and removes the partial folder; the free space is compared with the previous checkpoint's size before
writing. The data position is the iteration: batch ``k`` is a pure function of the data seed and ``k``
(``PromptDataset.batch``).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException, not an Exception)

from sparse_rl_mega.learner.model import Learner
from sparse_rl_mega.learner.weights import as_chunks, chunks_sharded_state_dict
from sparse_rl_mega.runtime.checkpoint_files import (MARKER, checkpoint_bytes, complete_checkpoints, data_files,
                                                     digest_of, free_bytes, newest_verified, read_marker, resume_candidates, size_text,
                                                     storage_cause, verify)
from sparse_rl_mega.runtime.jobs import JobWideError

SPACE_MARGIN = 1.05  # a new checkpoint may be this much larger than the previous one


class CheckpointNotSaved(JobWideError):
    """A checkpoint could not be written (every rank raises it, with the same line)."""


class CheckpointCorrupt(JobWideError):
    """The checkpoint to resume from does not verify, or none under the folder does."""


def verify_on_all_ranks(path: Path) -> Optional[str]:
    """:func:`verify` with the files shared among the ranks (a collective); every rank gets the first
    problem found, or None."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = verify(path, share=(rank, world))
    found: list = [None] * world
    dist.all_gather_object(found, mine)
    return next((p for p in found if p is not None), None)


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
    # its writer logs a failed write as an error line of its own; the save reports it (one line, named)
    logging.getLogger(filesystem_async.__name__).setLevel(logging.CRITICAL)


def _agree(problem: Optional[str]) -> Optional[str]:
    """Every rank's problem of a step of the save (None: it went well); every rank gets the first."""
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return next((p for p in found if p is not None), None)


def _not_saved(iteration: int, root: Path, target: Path, problem: str) -> CheckpointNotSaved:
    """The job-wide error of a failed save; rank 0 removes the partial folder first."""
    removed, free = "", free_bytes(root)
    if dist.get_rank() == 0 and target.exists():
        shutil.rmtree(target, ignore_errors=True)
        removed = f"; the partial {target.name} was removed"
    newest = complete_checkpoints(root)
    return CheckpointNotSaved(
        f"checkpoint of iteration {iteration} not saved: {problem}"
        + (f" ({size_text(free)} free)" if free is not None and "free" not in problem else "") + removed
        + f"; the newest complete checkpoint is {newest[-1] if newest else 'none'}")


def _space_problem(root: Path, target: Path) -> Optional[str]:
    """Rank 0, before writing: whether ``root`` has room for a checkpoint the size of the previous one."""
    previous = [p for p in complete_checkpoints(root) if p != target]
    free = free_bytes(root)
    if not previous or free is None:
        return None
    needed = checkpoint_bytes(previous[-1]) * SPACE_MARGIN
    reclaimed = checkpoint_bytes(target) if target.is_dir() else 0  # (rewritten: removed first)
    if free + reclaimed >= needed:
        return None
    return (f"{root}: {size_text(free)} free, the previous checkpoint ({previous[-1].name}) took "
            f"{size_text(checkpoint_bytes(previous[-1]))}; nothing was written")


def save_checkpoint(learner: Learner, ckpt_dir: str | Path, iteration: int, keep_last: int,
                    extra: Optional[dict] = None, rank0_extra: Optional[Callable[[Path], None]] = None
                    ) -> tuple[Path, int, float]:
    """Save after ``iteration`` iterations (every rank calls this). ``extra`` goes into the marker;
    ``rank0_extra(folder)``: rank 0 writes more files into the checkpoint folder (before the marker).
    Returns (folder, bytes, seconds spent on digests). A failed write raises :class:`CheckpointNotSaved`
    on every rank (the partial folder removed, older checkpoints untouched)."""
    from megatron.core import dist_checkpointing

    _writer_results_in_process()
    root = Path(ckpt_dir)
    target = root / f"iter_{iteration:07d}"
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. rank 0: room for it? then an empty folder (dist_checkpointing needs one)
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            problem = _space_problem(root, target)
            if problem is None:
                if target.exists():  # a partial save from a crashed run, or a rerun of the same iteration
                    shutil.rmtree(target)
                target.mkdir()
        except OSError as exc:
            problem = f"{root}: {storage_cause(exc, root)}"
    problem = _agree(problem)
    if problem is not None:
        raise _not_saved(iteration, root, target, problem)

    # 2. every rank writes its shards and RNG state; rank 0 its extra files
    try:
        model_state = chunks_sharded_state_dict(learner.modules)
        state = {"model": model_state, "optimizer": learner.optimizer.sharded_state_dict(model_state)}
        dist_checkpointing.save(state, str(target))
        (target / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), target / "rng" / f"rank_{rank}.pt")
        if rank == 0 and rank0_extra is not None:
            rank0_extra(target)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 (a storage error Megatron or torch wrapped)
        problem = f"{target}: {storage_cause(exc, target if target.is_dir() else root)}"
    problem = _agree(problem)
    if problem is not None:
        raise _not_saved(iteration, root, target, problem)

    # 3. size and XXH3-64 digest of every file, the files shared among the ranks (read back from the page cache)
    digest_started = time.perf_counter()
    names = [data_files(target) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine: dict[str, list] = {}
    try:
        for name in names[0][rank::world]:
            mine[name] = [(target / name).stat().st_size, digest_of(target / name)]
    except OSError as exc:
        problem = f"{target}: reading back {exc.filename}: {exc.strerror}"
    shares: list = [None] * world
    dist.all_gather_object(shares, (problem, mine))
    digest_seconds = time.perf_counter() - digest_started
    problem = next((p for p, _ in shares if p is not None), None)
    if problem is not None:
        raise _not_saved(iteration, root, target, problem)
    files = {name: entry for _, share in shares for name, entry in share.items()}

    # 4. rank 0: the marker (written whole, then renamed into place: never half a marker), then pruning
    if rank == 0:
        try:
            marker = {"iteration": iteration, "layout": _layout(), **(extra or {}), "files": files}
            partial = target / f".{MARKER}.partial"
            partial.write_text(json.dumps(marker, indent=1, default=str))
            os.replace(partial, target / MARKER)
        except OSError as exc:
            problem = f"{target / MARKER}: {storage_cause(exc, target)}"
        else:
            _prune(root, target, keep_last)
    problem = _agree(problem)
    if problem is not None:
        raise _not_saved(iteration, root, target, problem)
    return target, sum(size for size, _ in files.values()), digest_seconds


def _prune(root: Path, saved: Path, keep_last: int) -> None:
    """Keep ``saved`` and the ``keep_last - 1`` newest complete checkpoints before it; remove the older
    ones and any newer one (what a run resumed from an older checkpoint abandoned, e.g. one that did not
    verify). Nothing is removed unless ``saved`` has every file of the size its marker records."""
    if verify(saved, full=False) is not None:
        return
    complete = complete_checkpoints(root)
    older = [p for p in complete if p.name < saved.name]
    newer = [p for p in complete if p.name > saved.name]
    for old in older[:max(0, len(older) - (keep_last - 1))] + newer:
        shutil.rmtree(old, ignore_errors=True)


def choose_resume_checkpoint(spec: str, default_dir: str | Path, log: Callable[[str], None]) -> Optional[Path]:
    """(Every rank.) The checkpoint to resume from: the newest that verifies (sizes and XXH3-64 digest of every
    file, the files shared among the ranks); one that does not is skipped with a line naming the file
    and what differed. A checkpoint named explicitly that does not verify, or a folder where none does,
    raises :class:`CheckpointCorrupt` (one line). None: ``auto`` and no checkpoint at all."""
    listed = [resume_candidates(spec, default_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(listed, src=0)  # (one listing: ranks on other hosts see the same files)
    candidates, explicit = listed[0]
    try:
        return newest_verified(candidates, explicit, verify_on_all_ranks, log, "checkpoint.resume", "[setup]")
    except ValueError as exc:
        hint = "" if explicit else "; start anew in another trainer.run_dir, or with --overwrite"
        raise CheckpointCorrupt(f"{exc}{hint}") from None


def load_checkpoint(learner: Learner, path: str | Path) -> dict:
    """Load model and optimizer shards into this rank's learner (every rank calls this; the layout
    may differ from the one that saved) and restore the RNG when the layout is the same. Returns the
    marker (``iteration``, ``layout``, ...)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    marker = read_marker(path)
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
    loaded = dist_checkpointing.load({"model": chunks_sharded_state_dict(modules)}, str(path))
    _load_chunks(modules, loaded["model"])
    dist.barrier()
    return marker
