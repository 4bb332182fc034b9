#!/usr/bin/env python
"""Accuracy of a model under dense and under sparse (KV-compressed) inference, on one SGLang engine.

Every benchmark is decoded once per KV setting (``none`` = dense, or ``POLICY:BUDGET``) with the same
prompts, seeds and sampling, so the columns differ only by the KV cache. A ``POLICY:BUDGET`` setting
takes every other KV field (sink, window, interval, selection, kernel, lambda, ...) from ``--config``'s
``rollout.kv_compression`` (a run's config: evaluate as that run's rollouts decoded; ``rollout`` names
its own setting), else from the defaults below, each replaced by its flag when given. Reports per benchmark and
setting: mean@k (the mean correctness of k samples per problem; pass@1 with k=1 or greedy), pass@k
(unbiased estimator) and the mean response length; prints a table, writes ``results.json`` and a PNG plot,
and logs everything to MLflow.

    python tools/evaluate.py runs/assets/smollm2-135m-instruct --benchmarks gsm8k,math500 \\
        --kv none,rkv:64,snapkv:64,streaming:64 --limit 100
    # the paper's release R-KV (one kept set for all layers from the first layer's scores, no sinks):
    python tools/evaluate.py MODEL --benchmarks math500 --kv none,rkv:512 --selection shared --sink 0
    # as a run's rollouts decoded, dense and compressed:
    python tools/evaluate.py runs/my_run/checkpoints --config my_run.yaml --benchmarks math500 --kv none,rollout

MODEL is an HF folder, or a training checkpoint (an ``iter_*`` folder or a checkpoints folder), which
is first exported to an HF folder with ``tools/export_hf.py``. A benchmark is a jsonl of
``{"prompt", "label"}`` rows (``tools/prepare_data.py`` writes them): give a path, or a name looked up
as ``--data-dir/NAME.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF model folder, or a training checkpoint (iter_* or a checkpoints folder)")
    p.add_argument("--benchmarks", required=True, help="comma-separated jsonl paths or names in --data-dir")
    p.add_argument("--data-dir", default=str(ROOT / "runs" / "data"))
    p.add_argument("--kv", default="none",
                   help="comma-separated KV settings: none | POLICY:BUDGET (e.g. rkv:64) | rollout (--config's own)")
    p.add_argument("--config", default=None, help="a run config: the KV fields of its rollout.kv_compression")
    kv = p.add_argument_group("KV fields (default: --config's rollout.kv_compression, else the values shown)")
    kv.add_argument("--interval", type=int, help="decode steps between compressions (N; default 16)")
    kv.add_argument("--window", type=int, help="recent window / scoring queries (w; default 8)")
    kv.add_argument("--sink", type=int, help="first tokens always kept (default 4; the published R-KV/SnapKV: 0)")
    kv.add_argument("--selection", choices=["per_layer", "per_head", "shared"],
                    help="a kept set per layer (default), per KV head, or one for every layer (the paper's release)")
    kv.add_argument("--shared-scores", choices=["first_layer", "layer_sum"],
                    help="shared selection scored on the first layer (default, release) or all layers")
    kv.add_argument("--trigger", choices=["length", "newline"], help="also compress at line ends (default length)")
    kv.add_argument("--kernel", type=int, help="snapkv/rkv pooling kernel (odd; default 7)")
    kv.add_argument("--pool", choices=["max", "avg"], help="snapkv/rkv pooling (default max)")
    kv.add_argument("--gqa-pool", choices=["max", "mean"], help="snapkv/rkv over a KV head's queries (default max)")
    kv.add_argument("--lam", type=float, help="rkv importance weight (default 0.1)")
    kv.add_argument("--similarity-threshold", type=float, help="rkv near-duplicate threshold (default 0.5)")
    p.add_argument("--samples", type=int, default=1, help="samples per problem (k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (then --samples must be 1)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark")
    p.add_argument("--reward", default="math", help="reward type used as the correctness check (math | exact_answer)")
    p.add_argument("--max-total-tokens", type=int, default=16384,
                   help="engine KV pool size in tokens (SGLang's own CPU default takes most of the RAM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for results.json and accuracy.png (default runs/eval/<time>)")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default: sqlite in --out); 'none' to skip")
    p.add_argument("--experiment", default="evaluate")
    p.add_argument("--run-name", default=None)
    args = p.parse_args(argv)
    if args.temperature == 0.0 and args.samples != 1:
        p.error("--samples > 1 needs --temperature > 0 (greedy decoding gives one answer)")
    return args


KV_FIELDS = ("interval", "window", "sink", "selection", "shared_scores", "trigger", "kernel", "pool", "gqa_pool", "lam",
             "similarity_threshold")


def default_kv():
    """The KV fields without --config: the run config's defaults, compressing every 16 decode steps."""
    from sparse_rl_mega.config import KVCompressionConfig

    return KVCompressionConfig(interval=16)


def kv_base(args):
    """The KVCompressionConfig every ``POLICY:BUDGET`` setting takes its other fields from."""
    import dataclasses

    from sparse_rl_mega.config import load_config_or_exit

    base = load_config_or_exit(args.config).rollout.kv_compression if args.config else default_kv()
    return dataclasses.replace(base, **{f: getattr(args, f) for f in KV_FIELDS if getattr(args, f) is not None})


def parse_kv(spec: str, base=None) -> list[tuple[str, dict]]:
    """``none,rkv:64`` -> ``[("dense", {"policy": "none"}), ("rkv:64", {"policy": "rkv", "budget": 64, ...})]``
    (each compressed setting with every other field of ``base``, a KVCompressionConfig), checked as the
    engine will check it. Exits with one line naming the bad setting."""
    from sglang_patches.settings import EngineKVSettings
    from sparse_rl_mega.evaluation import parse_kv_variants
    from sparse_rl_mega.rollout.engine import check_request_kv

    base = base or default_kv()
    try:
        variants = parse_kv_variants(spec, base)
    except ValueError as exc:
        raise SystemExit(f"--kv: {exc}") from None
    engine = EngineKVSettings.from_config(base)
    for label, override in variants:
        try:
            check_request_kv(engine, override)
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"--kv {label}: {exc}") from None
    return variants


def resolve_model(model: str, workdir: Path) -> Path:
    """An HF folder as is; a training checkpoint exported to ``workdir/hf`` first."""
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    out = workdir / "hf"
    print(f"[evaluate] {model} is not an HF folder: exporting it with tools/export_hf.py ...", flush=True)
    code = subprocess.call([sys.executable, str(ROOT / "tools" / "export_hf.py"), str(path), "--out", str(out)])
    if code != 0:
        raise SystemExit(f"[evaluate] could not export {model} (exit {code})")
    return out


def load_benchmarks(names: str, data_dir: Path, limit) -> dict:
    from sparse_rl_mega.data.jsonl import PromptDataset

    out = {}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        path = Path(name) if name.endswith(".jsonl") else data_dir / f"{name}.jsonl"
        if not path.is_file():
            hint = "" if name.endswith(".jsonl") else " (make it with: python tools/prepare_data.py --benchmarks NAME)"
            raise SystemExit(f"[evaluate] benchmark {name}: {path} not found{hint}")
        records = PromptDataset(path).records
        out[path.stem] = records[:limit] if limit else records
    return out


def evaluate(model_dir: Path, benchmarks: dict, variants: list, base, args, log=print) -> dict:
    """Decode every benchmark under every KV setting on one engine (started with ``base``'s settings,
    a KVCompressionConfig, taking any other per request); returns nested results."""
    from transformers import AutoTokenizer

    from sparse_rl_mega.config import RewardConfig
    from sparse_rl_mega.data.formatting import encode_prompt
    from sparse_rl_mega.evaluation import evaluate_on_engine
    from sparse_rl_mega.reward import build_scorer
    from sparse_rl_mega.rollout.engine import RolloutEngine, engine_kv_settings

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    settings = engine_kv_settings(base, tokenizer)
    settings.allow_request_override = True
    started = time.perf_counter()
    engine = RolloutEngine(str(model_dir), settings, seed=args.seed, max_total_tokens=args.max_total_tokens)
    log(f"[evaluate] engine up in {time.perf_counter() - started:.1f} s ({engine.started})")
    results: dict = {}
    try:
        with build_scorer(RewardConfig(type=args.reward)) as scorer:
            for bench, records in benchmarks.items():
                results[bench] = evaluate_on_engine(
                    engine, [encode_prompt(tokenizer, r.prompt) for r in records], [r.label for r in records],
                    scorer, variants, n_samples=args.samples, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed, log=log, name=f"evaluate {bench}")
    finally:
        engine.shutdown()
    return results


def table(results: dict, k: int) -> str:
    variants = list(next(iter(results.values())).keys())
    lines = ["| benchmark | problems | " + " | ".join(f"{v} mean@{k}" for v in variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for bench, rows in results.items():
        problems = next(iter(rows.values()))["problems"]
        lines.append(f"| {bench} | {problems} | " + " | ".join(f"{rows[v]['mean_at_k']:.3f}" for v in variants) + " |")
    return "\n".join(lines)


def plot(results: dict, k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(next(iter(results.values())).keys())
    benches = list(results)
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(4, 1.8 * len(benches) * len(variants) / 2), 3.2))
    for j, variant in enumerate(variants):
        xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(benches))]
        ax.bar(xs, [results[b][variant]["mean_at_k"] for b in benches], width, label=variant)
    ax.set_xticks(range(len(benches)), benches)
    ax.set_ylabel(f"mean@{k}")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("accuracy: dense vs sparse KV")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log_to_mlflow(results: dict, args, out: Path) -> None:
    if args.tracking_uri == "none":
        return
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    from sparse_rl_mega.evaluation import scalar_items
    from sparse_rl_mega.tracking import default_tracking_uri

    mlflow.set_tracking_uri(args.tracking_uri or default_tracking_uri(out))
    mlflow.set_experiment(args.experiment)
    with mlflow.start_run(run_name=args.run_name):
        mlflow.log_params({k: str(v) for k, v in vars(args).items()})
        for bench, rows in results.items():
            for variant, row in rows.items():
                for key, value in scalar_items(row).items():
                    mlflow.log_metric(f"{bench}/{variant.replace(':', '_')}/{key}", value)
        mlflow.log_artifact(str(out / "results.json"))
        if (out / "accuracy.png").is_file():
            mlflow.log_artifact(str(out / "accuracy.png"))


def main(argv=None) -> int:
    from sparse_rl_mega.quiet import quiet_known_warnings

    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/quiet.py
    args = parse_args(argv)
    base = kv_base(args)
    variants = parse_kv(args.kv, base)
    from sparse_rl_mega.rollout.engine import preload_cpu_engines

    preload_cpu_engines()  # SGLang imported once, its processes forked from here (rollout/forkserver.py)
    out = Path(args.out or ROOT / "runs" / "eval" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    benchmarks = load_benchmarks(args.benchmarks, Path(args.data_dir), args.limit)
    with tempfile.TemporaryDirectory(prefix="evaluate-", dir=out) as workdir:
        model_dir = resolve_model(args.model, Path(workdir))
        results = evaluate(model_dir, benchmarks, variants, base, args)
    (out / "results.json").write_text(json.dumps({"model": args.model, "args": vars(args), "results": results},
                                                 indent=2))
    plot(results, args.samples, out / "accuracy.png")
    log_to_mlflow(results, args, out)
    print(table(results, args.samples))
    print(f"[evaluate] results in {out} (results.json, accuracy.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
