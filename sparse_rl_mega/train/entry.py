"""The entry point of every torchrun rank (``tools/launch.py``): folder locks, the process group, the
watchdog, then the :class:`~sparse_rl_mega.train.trainer.Trainer`; a failure as one line, every process
and lock released however it ends."""
from __future__ import annotations

import os
import signal
import sys
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.config import RunConfig
from sparse_rl_mega.learner.cpu_shims import apply_if_cpu
from sparse_rl_mega.rollout import shm_record
from sparse_rl_mega.rollout.engine_processes import preload_cpu_engines
from sparse_rl_mega.rollout.placement import hosts_an_engine
from sparse_rl_mega.runtime import watchdog
from sparse_rl_mega.runtime.jobs import (JobWideError, held_by_launcher, lock_job_folders, lost_a_peer, print_error,
                                         report_failure)
from sparse_rl_mega.train.trainer import Trainer


def run_training(cfg: RunConfig, launched_at: Optional[float] = None) -> None:
    """Entry point for one torchrun rank (``tools/launch.py`` calls it); ``launched_at``: when the
    launcher started (``time.time()``), from which start-up is counted."""
    from datetime import timedelta

    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException: Megatron's loads too)

    rank = int(os.environ.get("RANK", "0"))
    try:
        # started by torchrun itself (multi-node): rank 0 locks the job's folders; the launcher did otherwise
        locks = lock_job_folders(cfg) if rank == 0 and not held_by_launcher() else []
    except Exception as exc:  # noqa: BLE001 (FolderLocked: one line)
        print_error(f"[error] rank {rank}: {exc}")
        raise SystemExit(1) from None
    if hosts_an_engine(cfg, rank):  # (/dev/shm files of the engines: none outlives the job)
        shm_record.start_recording(cfg.trainer.run_dir, log=lambda line: print(line, flush=True))
    # Megatron's TP layers order their async gradient all-reduce after the matmul only with one CUDA
    # work queue (it warns otherwise; Megatron-LM's scripts export it); the engine does not inherit it
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    on_cpu = apply_if_cpu()
    torch.set_num_threads(cfg.trainer.torch_threads)
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # on GPU: NCCL for device tensors, gloo for the CPU tensors of the host-side work (correction,
    # metrics). A collective waits at most for an engine's restart
    # (rollout.startup_timeout_s) after a failed call (rollout.engine_timeout_s) and a bit more.
    r = cfg.rollout
    timeout = timedelta(seconds=max(1800.0, r.startup_timeout_s + 2 * r.engine_timeout_s + 300.0))
    if on_cpu and hosts_an_engine(cfg, rank):  # while this process runs one thread (rollout/forkserver.py)
        preload_cpu_engines()
    dist.init_process_group(backend="gloo" if on_cpu else "cpu:gloo,cuda:nccl", timeout=timeout)
    watchdog.start(cfg, rank, dist.get_world_size())
    trainer = Trainer(cfg, launched_at)
    ok = job_wide = stopped = False
    try:
        trainer.setup()
        trainer.run()
        ok = True
    except KeyboardInterrupt:  # Ctrl-C reaches the ranks too: their launcher says it
        stopped = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the agent passes it on again: the close goes on)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 (one line here, the traceback in the run folder)
        line = report_failure(exc, cfg.trainer.run_dir, rank)
        job_wide = isinstance(exc, JobWideError)
        # a rank that only lost its peers adds nothing to their own line, nor to rank 0's of a job-wide one
        if not lost_a_peer(exc) and not (job_wide and rank != 0):
            print_error(line)
    finally:
        trainer.close(ok, stopped)
        if dist.is_initialized():
            if ok or job_wide:  # (job-wide: the others wait for rank 0's line before they end)
                dist.barrier()
            watchdog.stop()
            dist.destroy_process_group()
        shm_record.stop_recording()
        for lock in locks:
            lock.release()
    sys.stdout.flush()
    if not ok:
        raise SystemExit(1)
