#!/usr/bin/env python
"""Dense vs compressed-KV rollouts on the same engine and model, side by side in one run.

For each variant (dense, and every KV policy at the same budget with each ``--selections`` kept-set
selection: ``rkv`` per layer, ``rkv/shared`` one set per request for every layer, ...) the same prompts
are decoded with ``ignore_eos`` to a fixed length on:

1. an engine with an unbounded pool: peak KV slots in use and output tokens/s;
2. an engine whose pool is too small for the dense batch to run at once (``--small-pool-fraction`` of
   what dense decoding needs; the default 0.45 still holds every request at its compressed size,
   prompt + budget + interval + 1): output tokens/s, where compressed requests are admitted by their
   compressed size and run concurrently while dense ones queue.

Each engine first runs every variant once on one prompt, untimed (``[bench] warm-up``), so that its
one-time start-up costs are not charged to the variant timed first. Prints ``name=value`` lines (per
variant also the K/V tokens copied and the side buffers), ratios (variant / dense) last, and writes
``--json``.

    python tools/bench_rollout.py --requests 32 --new-tokens 256 --budget 64 --json runs/bench_rollout.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _bootstrap  # noqa: E402, F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.kv import PolicyError, build_policy  # noqa: E402 (after the path)
from sparse_rl_mega.kv.registry import policy_class, policy_names  # noqa: E402 (after the path)

DEFAULT_MODEL = ROOT / "runs" / "assets" / "tiny-llama-sums"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="HF model folder (default: the CPU example's tiny model, built if missing)")
    p.add_argument("--requests", type=int, default=32, help="concurrent requests (prompts)")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--budget", type=int, default=64,
                   help="KV slots a compressed request keeps; more than --sink + --window (default: %(default)s)")
    p.add_argument("--interval", type=int, default=16, help="decode steps between compressions (default: %(default)s)")
    p.add_argument("--window", type=int, default=8,
                   help="recent tokens always kept, whose queries score the others (default: %(default)s)")
    p.add_argument("--sink", type=int, default=4, help="first tokens always kept (default: %(default)s)")
    policies = ",".join(policy_names())
    p.add_argument("--policies", default=policies, help=f"comma-separated subset of {policies}")
    p.add_argument("--selections", default="per_layer,shared",
                   help="kept-set selections of the scoring policies (per_layer, per_head, shared); a variant "
                        "is named POLICY (per_layer) or POLICY/SELECTION")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant; the fastest counts (CPU noise)")
    p.add_argument("--small-pool-fraction", type=float, default=0.45,
                   help="small pool size as a fraction of the slots dense decoding needs for all requests")
    p.add_argument("--compressed-pool", action="store_true",
                   help="size the small pool for the compressed batch instead: requests x (prompt + budget + "
                        "interval + 1) slots, +5 %% (every compressed request runs at once, dense ones queue)")
    p.add_argument("--pools", default="unbounded,small_pool", help="which engines to run (default: %(default)s)")
    p.add_argument("--no-dense", action="store_true",
                   help="skip the dense variant (only each policy's own figures, e.g. its time in compression; "
                        "no ratios)")
    p.add_argument("--json", default=None, help="write all figures here")
    args = p.parse_args(argv)
    for policy in (name for name in args.policies.split(",") if name):  # before any engine starts
        if policy not in policy_names():
            p.error(f"--policies: unknown policy {policy!r}; known: {', '.join(policy_names())}")
        try:
            build_policy(policy, sink=args.sink, window=args.window).check_budget(args.budget)
        except (PolicyError, ValueError) as exc:
            p.error(f"--budget {args.budget} with --sink {args.sink} --window {args.window} ({policy}): {exc}")
    return args


def ensure_model(path: Path) -> None:
    if (path / "config.json").is_file():
        return
    if path != DEFAULT_MODEL:
        sys.exit(f"--model {path}: no HF model folder there")
    from sparse_rl_mega.config import load_config
    from sparse_rl_mega.models.tiny import build_tiny_model

    cfg = load_config(ROOT / "examples" / "cpu_tiny.yaml")
    build_tiny_model(path, cfg.model.arch, cfg.model.create_tiny, str(ROOT / cfg.data.train_path))


def warm_up_tokens(args) -> int:
    """New tokens of a warm-up request: enough for one compression (the cache reaches budget + interval,
    after at least ``window`` decode steps for the scoring policies), at most ``--new-tokens``."""
    return min(args.new_tokens, max(args.budget + args.interval - args.prompt_tokens, args.window) + 2)


def warm_up(engine, prompts, args, variants) -> str:
    """Run every variant once, untimed, on one prompt, right after the engine starts: an engine's first
    requests pay one-time costs (lazy initialisation, first calls of each code path, kernel compilation
    on a GPU) that would otherwise be charged to whichever variant is timed first (with ``--repeats 1``
    a user saw dense at 8.4 tok/s against streaming's 721). Returns what was run, for the log."""
    tokens = warm_up_tokens(args)
    started = time.perf_counter()
    for _, override in variants:
        engine.generate(prompts[:1], n_samples=1, max_new_tokens=tokens, temperature=1.0, seed=7,
                        kv_override=override, ignore_eos=True)
    return f"{len(variants)} variant(s) x 1 request x {tokens} new tokens in {time.perf_counter() - started:.1f} s"


def run_variants(engine, prompts, args, variants) -> dict:
    results = {}
    for name, override in variants:
        seconds, peak, patch_share = float("inf"), 0, {}
        for _ in range(args.repeats):
            engine.flush_cache()
            before = engine.kv_stats()  # resets the peak and the H2O mass peak
            started = time.perf_counter()
            samples = engine.generate(prompts, n_samples=1, max_new_tokens=args.new_tokens, temperature=1.0, seed=7,
                                      kv_override=override, ignore_eos=True)
            elapsed = time.perf_counter() - started
            stats = engine.kv_stats()
            if elapsed < seconds:  # the patch's share of the fastest run's wall time
                patch_share = {k: (stats[k] - before[k]) / elapsed for k in ("compress_seconds", "hook_seconds")}
            seconds = min(seconds, elapsed)
            peak = max(peak, stats["peak_slots_in_use"])
            postponed = stats.get("skipped_no_room", 0)
            copied = stats["copied_tokens"] - before["copied_tokens"]
            side = stats["query_ring_bytes"] + stats["h2o_mass_peak_bytes"]
        tokens = sum(len(s.response_ids) for s in samples)
        results[name] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                         "peak_slots_in_use": peak, "pool_size": stats["pool_size"],
                         "compressions_postponed_total": postponed, "copied_tokens": copied,
                         "side_buffer_bytes": side,
                         "compress_time_share": patch_share["compress_seconds"],
                         "hook_time_share": patch_share["hook_seconds"]}
        print(f"  {name}: {tokens / seconds:.1f} tok/s, peak slots {peak}, K/V tokens copied {copied}, "
              f"side buffers {side / 2**20:.2f} MiB, postponed compressions "
              f"(engine total) {postponed}, time in compression {patch_share['compress_seconds']:.1%}, "
              f"in attention hooks {patch_share['hook_seconds']:.1%}", flush=True)
    return results


def main(argv=None) -> int:
    from sparse_rl_mega.runtime.quiet import quiet_known_warnings

    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/runtime/quiet.py
    args = parse_args(argv)
    import torch

    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine
    from sparse_rl_mega.rollout.engine_processes import preload_cpu_engines

    preload_cpu_engines()  # SGLang imported once, its processes forked from here (rollout/forkserver.py)
    torch.manual_seed(0)
    model = Path(args.model)
    ensure_model(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.requests)]
    kv = dict(budget=args.budget, sink=args.sink, window=args.window, interval=args.interval)
    variants = [("dense", {"policy": "none"})]
    for policy in (p for p in args.policies.split(",") if p):
        selections = (["per_layer"] if policy_class(policy).position_only
                      else [s for s in args.selections.split(",") if s])
        for selection in selections:
            name = policy if selection == "per_layer" else f"{policy}/{selection}"
            variants.append((name, {"policy": policy, "selection": selection}))
    policies = [name for name, _ in variants[1:]] if not args.no_dense else []
    if args.no_dense:
        variants = variants[1:]
    settings = EngineKVSettings(policy="none", allow_request_override=True, compressed_admission=True, **kv)
    dense_need = args.requests * (args.prompt_tokens + args.new_tokens)
    compressed_need = args.requests * (args.prompt_tokens + args.budget + args.interval + 1)
    small_pool = (int(compressed_need * 1.05) if args.compressed_pool
                  else int(dense_need * args.small_pool_fraction))
    pools = [p for p in args.pools.split(",") if p]
    if not pools or set(pools) - {"unbounded", "small_pool"}:
        sys.exit(f"--pools {args.pools!r}: expected unbounded and/or small_pool")

    figures = {"config": {**vars(args), "dense_slots_needed": dense_need, "compressed_slots_needed": compressed_need,
                          "small_pool": small_pool}}
    for label, pool in (("unbounded", dense_need * 2 + 1024), ("small_pool", small_pool)):
        if label not in pools:
            continue
        print(f"[{label}] engine with a {pool}-slot pool", flush=True)
        engine = RolloutEngine(str(model), settings, max_total_tokens=pool, max_running_requests=args.requests,
                               seed=0)
        try:
            print(f"[bench] warm-up: {warm_up(engine, prompts, args, variants)} (not measured)", flush=True)
            figures[label] = run_variants(engine, prompts, args, variants)
        finally:
            engine.shutdown()

    lines = []
    for label in pools:
        for name, r in figures[label].items():
            lines.append(f"{label}.{name}.tokens_per_s={r['tokens_per_s']:.2f}")
            lines.append(f"{label}.{name}.peak_slots_in_use={r['peak_slots_in_use']}")
    ratios = {}
    for name in policies:
        if "unbounded" in pools:
            unbounded = figures["unbounded"]
            ratios[f"peak_slots_ratio.{name}"] = (unbounded[name]["peak_slots_in_use"]
                                                  / max(unbounded["dense"]["peak_slots_in_use"], 1))
            ratios[f"throughput_ratio_unbounded.{name}"] = (unbounded[name]["tokens_per_s"]
                                                            / unbounded["dense"]["tokens_per_s"])
        if "small_pool" in pools:
            ratios[f"throughput_ratio_small_pool.{name}"] = (figures["small_pool"][name]["tokens_per_s"]
                                                             / figures["small_pool"]["dense"]["tokens_per_s"])
    figures["ratios"] = ratios
    print("\n".join(lines))
    print("\n".join(f"{k}={v:.3f}" for k, v in ratios.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
