"""Export a training checkpoint as a Hugging Face model folder (transformers and SGLang load it).

examples:
  python tools/export_hf.py runs/cpu_tiny/checkpoints --out runs/cpu_tiny/hf-latest
  python tools/export_hf.py runs/cpu_tiny/checkpoints/iter_0000002 --out /tmp/hf-it2 --dtype bfloat16
  python tools/export_hf.py CKPT --out DIR --nproc 2 --pp 2      # load with 2 processes (pipeline split)

CHECKPOINT is one checkpoint (an iter_NNNNNNN folder holding sparse_rl_mega.json) or a folder of
checkpoints (its newest complete one is taken). The output folder gets the weights, HF-named:
model.safetensors, or model-0000K-of-0000N.safetensors plus model.safetensors.index.json when they
exceed --max-shard-mb; and config.json, the tokenizer files and generation_config.json copied from the
run's initial HF model folder (recorded in the checkpoint; --model names another one, e.g. when the run
was made on another machine). A checkpoint saved with any TP/PP layout loads into any export layout
(dist_checkpointing reshards it); the default, one process at TP1 PP1 on the CPU, needs the whole
model in the memory of one process (--nproc with --tp/--pp splits it; --device cuda loads on GPUs).
The folder is written next to --out and renamed into place at the end, so an interrupted export
leaves no half-written --out.

Run it with python: it runs torchrun's agent itself, its ranks on the CPU forks of a process that imported
their modules once (sparse_rl_mega/train/forked_ranks.py); or start it under torchrun with --nproc-per-node N.
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sparse_rl_mega.config import ConfigError, RunConfig, config_from_dict
from sparse_rl_mega.learner.export import ShardWriter, copy_model_files, put_in_place
from sparse_rl_mega.runtime.checkpoint_files import MARKER, newest_verified, read_marker, resume_candidates, verify
from sparse_rl_mega.runtime.quiet import quiet_known_warnings
from sparse_rl_mega.train.forked_ranks import run_script_ranks, start_rank_server
from sparse_rl_mega.runtime.paths import ROOT

EXPORT_SCRIPT = ROOT / "tools" / "export_hf.py"  # what every rank runs

# what a rank imports: the learner's model, its checkpoints and the HF weight map
EXPORT_MODULES = ("sparse_rl_mega.learner.model", "sparse_rl_mega.learner.checkpoint", "sparse_rl_mega.learner.weights",
                  "safetensors.torch")


class ExportError(Exception):
    """A problem with the arguments or the inputs, reported as one line (exit status 2)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="export_hf.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="an iter_NNNNNNN checkpoint folder, or a folder of them (newest complete "
                                           "one), e.g. runs/cpu_tiny/checkpoints")
    parser.add_argument("--out", required=True, type=Path, help="the HF folder to write (must not exist or be empty)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="dtype of the written weights (default: the run's model.dtype)")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model folder to take config.json and the tokenizer from (default: the run's initial "
                             "model, recorded in the checkpoint); its config.json must describe the same architecture")
    parser.add_argument("--max-shard-mb", type=float, default=2000.0,
                        help="largest safetensors file in MiB; larger weights are split into several files with an "
                             "index (default 2000)")
    parser.add_argument("--nproc", type=int, default=1, help="processes to load the checkpoint with (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the export (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the export (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model is loaded: cpu (default: gloo, leaves the GPUs alone) or cuda "
                             "(one GPU per process, NCCL + gloo)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    return parser.parse_args(argv)


@dataclass
class Plan:
    checkpoint: Path  # the iter_* folder
    marker: dict
    model_dir: Path  # config.json + tokenizer come from here
    cfg: RunConfig  # the run's config at the export layout
    out: Path
    dtype: str


def _resolve_model_dir(recorded: str) -> Path:
    """The run's model.path as recorded (relative paths: to the current folder, else to the repo root)."""
    path = Path(recorded)
    if path.is_absolute() or path.is_dir():
        return path
    return ROOT / path if (ROOT / path).is_dir() else path


def export_config(saved: dict, model_dir: Path, nproc: int, tp: int, pp: int, source: str) -> RunConfig:
    """The run's recorded config with the export's layout. Settings that only matter for training but
    are validated against the layout (batch split, engines) are set to trivially valid values."""
    raw = copy.deepcopy(saved)
    raw["model"]["path"] = str(model_dir)
    raw["parallel"].update(nnodes=1, nproc_per_node=nproc, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=pp, sequence_parallel=False,
                           virtual_pipeline_model_parallel_size=1, context_parallel_size=1)
    dp = max(1, nproc // (tp * pp))
    group = raw["rollout"]["n_samples_per_prompt"]
    raw["rollout"].update(num_engines=1, engine_tensor_parallel_size=1, placement="colocated")
    raw["data"]["prompts_per_iteration"] = dp
    raw["trainer"].update(global_batch_size=dp * group, micro_batch_size=1)
    raw["checkpoint"]["resume"] = None
    return config_from_dict(raw, source)


def prepare(args: argparse.Namespace, nproc: int) -> Plan:
    """Check everything that can be checked before loading; raise :class:`ExportError` with a clear message."""

    spec = Path(args.checkpoint)
    if not spec.exists():
        raise ExportError(f"{spec}: no such checkpoint folder")
    try:
        candidates, explicit = resume_candidates(str(spec), spec)
    except FileNotFoundError:
        raise ExportError(f"{spec}: no complete checkpoint there (expected {MARKER} in it, or iter_* folders "
                          f"holding one under it; a checkpoint still being written has none yet)") from None
    try:  # the sizes and digests of every file, as a resumed run checks them; the newest that verifies
        checkpoint = newest_verified(candidates, explicit, verify, lambda line: print(line, flush=True), "checkpoint",
                                     "[export]")
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if not explicit:
        print(f"[export] {checkpoint.name}: the newest of the {len(candidates)} complete checkpoint(s) under {spec} "
              f"that verifies", flush=True)
    marker = read_marker(checkpoint)
    if "config" not in marker or "iteration" not in marker:
        raise ExportError(f"{checkpoint}: {MARKER} is not a training checkpoint's marker (no 'iteration' / 'config'; "
                          f"is this an HF model folder?)")

    recorded = marker.get("initial_model") or marker["config"]["model"]["path"]
    model_dir = Path(args.model) if args.model is not None else _resolve_model_dir(recorded)
    hint = ("pass --model HF_DIR: an HF folder of the run's model (config.json + tokenizer files, the same "
            "architecture) to take config and tokenizer from")
    where = ("given by --model" if args.model is not None
             else f"the run's initial model, recorded in {checkpoint / MARKER}")
    if not model_dir.is_dir():
        raise ExportError(f"HF model folder {model_dir} ({where}) does not exist; {hint}")
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"HF model folder {model_dir} ({where}) has no config.json; {hint}")

    try:
        cfg = export_config(marker["config"], model_dir, nproc, args.tp, args.pp,
                            source=f"{checkpoint / MARKER} (export layout --nproc/--tp/--pp)")
    except ConfigError as error:
        raise ExportError(f"config error: {error}") from None

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ExportError(f"--out {out} is not empty (pass --force to replace it)")
    if args.max_shard_mb <= 0:
        raise ExportError(f"--max-shard-mb must be > 0, got {args.max_shard_mb}")
    return Plan(checkpoint=checkpoint, marker=marker, model_dir=model_dir, cfg=cfg, out=out,
                dtype=args.dtype or cfg.model.dtype)


# ----------------------------------------------------------------------------- writing (rank 0)


def run_export(args: argparse.Namespace) -> int:
    from sparse_rl_mega.learner.cpu_shims import apply_if_cpu, seed_model_parallel_rng

    on_cpu = apply_if_cpu()
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and on_cpu:
        print("export_hf.py: --device cuda: no GPU visible to torch", file=sys.stderr)
        return 2

    try:
        plan = prepare(args, nproc=int(os.environ["WORLD_SIZE"]))
    except ExportError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"export_hf.py: {error}", file=sys.stderr)
        return 2
    cfg = plan.cfg
    torch.set_num_threads(cfg.trainer.torch_threads)
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # CPU tensors travel over gloo also when the model lives on GPUs (the gather sends CPU copies)
    dist.init_process_group(backend="gloo" if on_cpu else "cpu:gloo,cuda:nccl")
    rank = dist.get_rank()
    log = (lambda message: print(message, flush=True)) if rank == 0 else (lambda message: None)
    temporary = plan.out.parent / f".{plan.out.name}.partial-{os.getpid()}"
    try:
        from megatron.core import parallel_state as ps

        from sparse_rl_mega.learner.checkpoint import load_model_weights
        from sparse_rl_mega.learner.model import build_model
        from sparse_rl_mega.learner.weights import stream_hf_tensors

        p = cfg.parallel
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tensor_model_parallel_size,
                                     pipeline_model_parallel_size=p.pipeline_model_parallel_size)
        seed_model_parallel_rng(cfg.trainer.seed)
        started = time.perf_counter()
        module = build_model(cfg, initialize=False)
        load_model_weights(module, plan.checkpoint)
        saved = plan.marker.get("layout", {})
        log(f"[export] loaded {plan.checkpoint} (iteration {plan.marker['iteration']}, saved at TP"
            f"{saved.get('tensor_model_parallel_size')} PP{saved.get('pipeline_model_parallel_size')}) at TP"
            f"{p.tensor_model_parallel_size} PP{p.pipeline_model_parallel_size} "
            f"in {time.perf_counter() - started:.1f} s")

        writer = None
        if rank == 0:
            temporary.mkdir(parents=True)
            writer = ShardWriter(temporary, int(args.max_shard_mb * 2**20), getattr(torch, plan.dtype))
        for name, tensor in stream_hf_tensors(module, cfg.model.arch, dst=0):
            writer.add(name, tensor)  # only rank 0 receives tensors
        if rank == 0:
            weights = writer.finish()
            copied = copy_model_files(plan.model_dir, temporary, plan.dtype)
            if plan.out.is_dir() and any(plan.out.iterdir()) and not args.force:
                raise ExportError(f"--out {plan.out} was filled while exporting (pass --force to replace it)")
            put_in_place(temporary, plan.out)
            log(f"[export] wrote {len(writer.seen)} tensors ({writer.total_bytes / 2**20:.1f} MiB, {plan.dtype}) in "
                f"{len([w for w in weights if w.endswith('.safetensors')])} safetensors file(s), and "
                f"{', '.join(copied)} from {plan.model_dir}")
            log(f"[export] done: {plan.out}")
        dist.barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv=None) -> int:

    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/runtime/quiet.py
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.device == "cpu":  # before CUDA is initialised
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return run_export(args)
    if args.nproc < 1:
        print(f"export_hf.py: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    # before torch is imported (below): what torchrun sets for its workers, and CUDA hidden from them and
    # from this process, which forks them on the CPU (its OpenMP pool would start a thread here)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:  # fail here, before any process starts, on anything that can be checked up front
        plan = prepare(args, nproc=args.nproc)
    except ExportError as error:
        print(f"export_hf.py: {error}", file=sys.stderr)
        return 2

    # (no --nproc for the workers: torchrun would take it for an abbreviation of its --nproc-per-node;
    # under torchrun the world size is the process count)
    worker_args = [str(plan.checkpoint.resolve()), "--out", str(plan.out.resolve()), "--model", str(plan.model_dir.resolve()),
                   "--dtype", plan.dtype, "--max-shard-mb", str(args.max_shard_mb), "--tp", str(args.tp),
                   "--pp", str(args.pp), "--device", args.device] + (["--force"] if args.force else [])
    print(f"[export] {plan.checkpoint} -> {plan.out} ({args.nproc} process(es), TP{args.tp} PP{args.pp}, {plan.dtype})",
          flush=True)
    # the ranks are forks of a server that imported their modules once (on the CPU; else exec'd)
    forked = start_rank_server(EXPORT_MODULES)
    return run_script_ranks(args.nproc, str(EXPORT_SCRIPT), worker_args, forked, "export")

