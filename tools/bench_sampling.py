#!/usr/bin/env python
"""What carrying the behaviour policy's support costs: top-k / top-p rollouts with and without each
token's sampling support (SGLang's ``return_sampling_mask``), side by side on one engine.

The same prompts are decoded (dense KV, ``ignore_eos``, a fixed length, temperature ``--temperature``)
with each truncation in ``--truncations`` twice: once reporting only the sampled tokens' logprobs (what
the trainer did before it renormalised over supports) and once reporting every token's support. For
each, the fastest of ``--repeats`` runs gives output tokens/s; with supports also the mean and largest
support (ids per token) and the bytes a token carries to the learner: 4 per support id (int32), and
4 more for its count in the packed batch (the learner pads a micro-batch's supports to its widest). Last, on the learner's side, the support mask that ``vocab_parallel`` builds per
micro-batch against a log-softmax of the same logits ``[--mask-batch, --new-tokens, vocab]``.

Prints ``name=value`` lines, the ratios last (with support / without), and writes ``--json``.

    python tools/bench_sampling.py --model runs/assets/smollm2-135m-instruct --truncations top_k=20,top_p=0.9
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
from bench_rollout import DEFAULT_MODEL, ensure_model  # noqa: E402 (the same model; tools/ is the script's folder)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="HF model folder (default: the CPU example's tiny model, built if missing)")
    p.add_argument("--requests", type=int, default=16, help="concurrent requests (prompts)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--truncations", default="top_k=5,top_k=50,top_p=0.9,top_k=50+top_p=0.9",
                   help="comma-separated truncations, each top_k=K, top_p=P or both joined by '+' "
                        "(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant; the fastest counts (CPU noise)")
    p.add_argument("--mask-batch", type=int, default=4, help="sequences of the learner-side mask measurement")
    p.add_argument("--json", default=None, help="write all figures here")
    return p.parse_args(argv)


def parse_truncation(text: str) -> dict:
    """``top_k=50+top_p=0.9`` -> ``{"top_k": 50, "top_p": 0.9}`` (one line naming a bad part)."""
    out = {}
    for part in text.split("+"):
        key, _, value = part.partition("=")
        if key == "top_k" and value.isdigit() and int(value) >= 2:
            out["top_k"] = int(value)
        elif key == "top_p" and value and 0 < float(value) < 1:
            out["top_p"] = float(value)
        else:
            sys.exit(f"--truncations: {part!r}: expected top_k=K (K >= 2) or top_p=P (0 < P < 1)")
    return out


def run_variant(engine, prompts, args, truncation: dict, report_support: bool) -> dict:
    seconds, samples = float("inf"), None
    for _ in range(args.repeats):
        engine.flush_cache()
        started = time.perf_counter()
        samples = engine.generate(prompts, n_samples=1, max_new_tokens=args.new_tokens, temperature=args.temperature,
                                  top_p=truncation.get("top_p", 1.0), top_k=truncation.get("top_k", -1), seed=7,
                                  ignore_eos=True, report_support=report_support)
        seconds = min(seconds, time.perf_counter() - started)
    tokens = sum(len(s.response_ids) for s in samples)
    out = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
    if report_support:
        sizes = [len(ids) for s in samples for ids in s.support]
        mean = sum(sizes) / len(sizes)
        out.update(support_mean=mean, support_max=max(sizes), reply_bytes_per_token=4 * mean,
                   batch_bytes_per_token=4 * mean + 4)
    return out


def mask_cost(vocab: int, args) -> dict:
    """Seconds of ``support_mask`` and of a log-softmax over logits ``[mask_batch, new_tokens, vocab]``
    (supports of 50 ids), fastest of 5."""
    import torch

    from sparse_rl_mega.learner.vocab_parallel import support_mask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.mask_batch, args.new_tokens, vocab, generator=g)
    ids = torch.randint(0, vocab, (args.mask_batch, args.new_tokens, 50), generator=g, dtype=torch.int32)

    def fastest(call) -> float:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - started)
        return best

    return {"support_mask_s": fastest(lambda: support_mask(ids, 0, vocab)),
            "log_softmax_s": fastest(lambda: torch.log_softmax(logits, dim=-1))}


def main(argv=None) -> int:
    from sparse_rl_mega.runtime.quiet import quiet_known_warnings

    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/runtime/quiet.py
    args = parse_args(argv)
    truncations = {text: parse_truncation(text) for text in args.truncations.split(",") if text}
    import torch

    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine
    from sparse_rl_mega.rollout.engine_processes import preload_cpu_engines

    preload_cpu_engines()  # SGLang imported once, its processes forked from here (rollout/forkserver.py)
    model = Path(args.model)
    ensure_model(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.requests)]
    figures = {"config": {**vars(args), "vocab": vocab}, "variants": {}}
    # one engine reporting supports up to the vocabulary (top-p alone needs that much)
    engine = RolloutEngine(str(model), EngineKVSettings(policy="none"), max_total_tokens=args.requests *
                           (args.prompt_tokens + args.new_tokens) + 1024, max_running_requests=args.requests,
                           seed=0, support_top_k=-1)
    try:
        run_variant(engine, prompts[:1], argparse.Namespace(**{**vars(args), "repeats": 1}),
                    next(iter(truncations.values())), True)  # (warm-up: the engine's first calls, not measured)
        for text, truncation in truncations.items():
            for report in (False, True):
                name = f"{text}/{'support' if report else 'logprob'}"
                figures["variants"][name] = result = run_variant(engine, prompts, args, truncation, report)
                extra = (f", support {result['support_mean']:.1f} ids mean, {result['support_max']} max: "
                         f"{result['reply_bytes_per_token']:.0f} B/token replied, {result['batch_bytes_per_token']:.0f} "
                         f"B/token in the batch" if report else "")
                print(f"  {name}: {result['tokens_per_s']:.1f} tok/s{extra}", flush=True)
    finally:
        engine.shutdown()
    figures["learner"] = mask_cost(vocab, args)
    lines = [f"{name}.tokens_per_s={r['tokens_per_s']:.2f}" for name, r in figures["variants"].items()]
    lines += [f"{name}.support_mean={r['support_mean']:.2f}" for name, r in figures["variants"].items()
              if "support_mean" in r]
    lines += [f"learner.{key}={value:.5f}" for key, value in figures["learner"].items()]
    ratios = {f"throughput_ratio.{text}": figures["variants"][f"{text}/support"]["tokens_per_s"]
              / figures["variants"][f"{text}/logprob"]["tokens_per_s"] for text in truncations}
    ratios["support_mask_over_log_softmax"] = figures["learner"]["support_mask_s"] / figures["learner"]["log_softmax_s"]
    figures["ratios"] = ratios
    lines += [f"{key}={value:.3f}" for key, value in ratios.items()]
    print("\n".join(lines))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
