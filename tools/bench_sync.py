#!/usr/bin/env python
"""Weight push, learner -> engines: seconds per push beside a plain copy of the same bytes, with its parts.

Builds the run's learner (its TP/PP layout) and engines exactly as training does, then times
``EngineFleet.push_weights`` for each sync method and bucket size: every owning rank packs its
flattened buckets, the engines load them (shared buffers or a broadcast), the session ends with the
new version and a cache flush, and the served version is checked. Measured in the same run, on rank 0:

* ``copy``: ``Tensor.copy_`` of the same number of bytes (moving the bytes at memory speed), timed
  before every timed push; the fastest of all counts, as for the pushes;
* ``gather``: the former push's learner side alone, streaming every HF tensor to rank 0.

Each setting starts with an untimed push (it allocates the owners' buffers, which the engines then map
once). Each push prints every rank's parts (``time/sync_*`` in docs/metrics.md: pack, send, wait, load,
session), summed over buckets (they overlap in time), and then one more push with the post-push
dense-logprob check, whose cost is given apart. Prints ``name=value`` lines, ratios to the copy last,
and writes ``--json``.

    python tools/bench_sync.py examples/cpu_smollm2.yaml --repeats 5 --json runs/bench_sync.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import _bootstrap  # noqa: E402, F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(ROOT / "examples" / "cpu_tiny.yaml"),
                   help="run config whose model, layout and engine are used (default: examples/cpu_tiny.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable), as in tools/launch.py")
    p.add_argument("--buckets", default=None,
                   help="bucket sizes in MB, comma-separated (default: the config's trainer.sync_bucket_mb)")
    p.add_argument("--methods", default="tensor,broadcast", help="sync methods: tensor, broadcast")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per setting; the fastest counts (CPU noise)")
    p.add_argument("--json", default=None, help="write all figures here")
    return p.parse_args(argv)


def _fastest(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def bench(args: argparse.Namespace) -> None:
    """One torchrun rank."""
    import torch
    import torch.distributed as dist

    from sparse_rl_mega.config import load_config
    from sparse_rl_mega.learner.cpu_shims import apply_if_cpu
    from sparse_rl_mega.learner.weights import stream_hf_tensors
    from sparse_rl_mega.rollout.engine_processes import preload_cpu_engines
    from sparse_rl_mega.rollout.placement import hosts_an_engine
    from sparse_rl_mega.train.console import PhaseTimer
    from sparse_rl_mega.train.trainer import Trainer

    cfg = load_config(args.config, args.overrides + ["tracking.enabled=false", "checkpoint.resume=null"])
    on_cpu = apply_if_cpu()
    torch.set_num_threads(cfg.trainer.torch_threads)
    if on_cpu and hosts_an_engine(cfg, int(os.environ["RANK"])):  # as run_training: SGLang imported once
        preload_cpu_engines()
    dist.init_process_group(backend="gloo" if on_cpu else "nccl")
    trainer = Trainer(cfg)
    rank = dist.get_rank()
    try:
        trainer.setup()
        module, arch = trainer.learner.modules, cfg.model.arch

        def gather_only():
            total = 0
            for _, tensor in stream_hf_tensors(module, arch):
                total += tensor.numel()
            return total

        elements = [0]
        gather_s = _fastest(lambda: elements.__setitem__(0, gather_only()), args.repeats)
        figures: dict = {"config": {**vars(args), "world_size": dist.get_world_size(),
                                    "tp": cfg.parallel.tensor_model_parallel_size,
                                    "pp": cfg.parallel.pipeline_model_parallel_size}, "sync": {}, "parts": {}}
        dtype = torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16
        nbytes = elements[0] * dtype.itemsize
        copies: list[float] = []  # every timing of the plain copy (rank 0)
        src = torch.empty(nbytes // 4, dtype=torch.float32).normal_() if rank == 0 else None
        dst = torch.empty_like(src) if rank == 0 else None

        def copy_once() -> None:
            if rank == 0:
                started = time.perf_counter()
                dst.copy_(src)
                copies.append(time.perf_counter() - started)
        for _ in range(args.repeats):
            copy_once()
        if rank == 0:
            figures.update(bytes=nbytes, gather_s=gather_s)
            print(f"[bench_sync] {nbytes / 2**20:.1f} MiB of weights; gather to rank 0 {gather_s:.3f} s, "
                  f"plain copy {min(copies):.4f} s", flush=True)
        fleet, version = trainer.fleet, trainer.fleet.version
        probe = list(range(1, 33))  # a 32-token sequence for the post-push logprob check
        for method in [m for m in args.methods.split(",") if m]:
            if method != cfg.trainer.sync_method:  # (every rank) the groups this method broadcasts over
                cfg.trainer.sync_method = method
                fleet.form_weight_group()
            sizes = args.buckets.split(",") if args.buckets else [str(cfg.trainer.sync_bucket_mb)]
            for mb in [float(b) for b in sizes if b]:
                cfg.trainer.sync_bucket_mb = mb
                fleet.push_weights(None, version, PhaseTimer())  # untimed: allocates and maps the buffers
                best = None
                for _ in range(args.repeats):
                    copy_once()  # side by side: the machine's state of the moment for both
                    started = time.perf_counter()
                    parts = fleet.push_weights(None, version, PhaseTimer())
                    seconds = time.perf_counter() - started
                    if best is None or seconds < best[0]:
                        best = (seconds, parts)
                seconds, parts = best
                checked = fleet.push_weights(probe, version, PhaseTimer(), check_before=False)
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, {k: v for k, v in parts.items() if k.startswith("time/sync_")})
                if rank == 0:
                    name = f"{method}.{mb:g}MB"
                    figures["sync"][name] = seconds
                    figures["parts"][name] = {"buckets": parts["sync/buckets"], "check_s": checked["time/sync_check_s"],
                                              "ranks": everyone}
                    print(f"[bench_sync] {method}, buckets of {mb:g} MB ({parts['sync/buckets']:.0f}): "
                          f"{seconds:.3f} s per push; " + "; ".join(
                              f"rank {r}: " + ", ".join(f"{k[len('time/sync_'):-2]} {v:.3f}" for k, v in t.items()
                                                       if v > 0 and k != "time/sync_push_s")
                              for r, t in enumerate(everyone)) + f"; then the logprob check {checked['time/sync_check_s']:.3f} s",
                          flush=True)
        if rank == 0:
            figures["copy_s"] = min(copies)
            lines = [f"bytes={figures['bytes']}", f"gather_s={gather_s:.4f}", f"copy_s={figures['copy_s']:.5f}"]
            lines += [f"sync_s.{k}={v:.4f}" for k, v in figures["sync"].items()]
            lines += [f"check_s.{k}={v['check_s']:.4f}" for k, v in figures["parts"].items()]
            ratios = {f"sync_over_copy.{k}": v / figures["copy_s"] for k, v in figures["sync"].items()}
            ratios["gather_over_copy"] = gather_s / figures["copy_s"]
            figures["ratios"] = ratios
            print("\n".join(lines + [f"{k}={v:.1f}" for k, v in ratios.items()]), flush=True)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(figures, indent=2))
    finally:
        trainer.close(True)
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    from sparse_rl_mega.runtime.quiet import quiet_known_warnings

    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/runtime/quiet.py
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        bench(args)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (before torch: its OpenMP pool would start a thread)
    from sparse_rl_mega.config import load_config_or_exit
    from sparse_rl_mega.train.forked_ranks import run_script_ranks, start_job_rank_server

    cfg = load_config_or_exit(args.config, args.overrides)
    from sparse_rl_mega.cli.preflight import preflight

    problems = preflight(cfg).problems  # the inputs tools/launch.py checks (data, model folder, lengths)
    if problems:
        for line in problems:
            print(f"config error: {args.config}: {line}", file=sys.stderr)
        return 2
    # torchrun's agent here, the ranks forked from here on a CPU (as tools/launch.py runs a job)
    return run_script_ranks(cfg.parallel.nproc_per_node, str(Path(__file__).resolve()), list(argv or sys.argv[1:]),
                            start_job_rank_server(cfg), "bench_sync")


if __name__ == "__main__":
    sys.exit(main())
