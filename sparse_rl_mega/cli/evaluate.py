"""Accuracy of a model under dense and under sparse (KV-compressed) inference, on one SGLang engine.

Every benchmark is decoded once per KV setting (``none`` = dense, or ``POLICY:BUDGET``) with the same
prompts, seeds and sampling, so the columns differ only by the KV cache. A ``POLICY:BUDGET`` setting
takes every other KV field (sink, window, interval, selection, kernel, lambda, ...) from ``--config``'s
``rollout.kv_compression`` (a run's config: evaluate as that run's rollouts decoded; ``rollout`` names
its own setting), else from the defaults shown by ``--help``; a field's flag, when given, always wins.
Without ``--config`` the sink and window follow each setting's budget B, so that every budget the
policies can run (B >= 2) runs: window = min(8, B // 4) (at least 1), sink = min(4, B // 8), i.e. the
run config's 8 and 4 from B = 32 on. Reports per benchmark and setting: mean@k (the mean correctness
of k samples per problem; pass@1 with k=1 or greedy), pass@k (unbiased estimator) and the mean
response length; prints a table, writes ``results.json`` and a PNG plot, and logs everything to MLflow.

    python tools/evaluate.py runs/assets/smollm2-135m-instruct --benchmarks gsm8k,math500 \\
        --kv none,rkv:64,snapkv:64,streaming:64 --limit 100
    # the paper's release R-KV (one kept set for all layers from the first layer's scores, no sinks):
    python tools/evaluate.py MODEL --benchmarks math500 --kv none,rkv:512 --selection shared --sink 0
    # as a run's rollouts decoded, dense and compressed:
    python tools/evaluate.py runs/my_run/checkpoints --config my_run.yaml --benchmarks math500 --kv none,rollout

MODEL is an HF folder, or a training checkpoint (an ``iter_*`` folder or a checkpoints folder), which
is first exported to an HF folder with ``tools/export_hf.py``. A benchmark is a jsonl of
``{"prompt", "label"}`` rows (``tools/prepare_data.py`` writes them): give a path, or a name looked up
as ``--data-dir/NAME.jsonl``. The command line (numbers, KV settings, model, benchmarks) is checked
before anything heavy starts: a problem is one ``evaluate.py: error:`` line, exit status 2.
``--max-new-tokens`` is capped to what the model's positions leave after the longest prompt.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sparse_rl_mega.cli.kv_settings import (UsageError, default_kv, derived_fields, kv_base,
                                            parse_kv, policy_param_flags)
from sparse_rl_mega.cli.preflight import PromptTokenCounter, response_room
from sparse_rl_mega.config import RewardConfig
from sparse_rl_mega.data.formatting import encode_prompt
from sparse_rl_mega.data.jsonl import DataError, PromptDataset
from sparse_rl_mega.data.prepare import DEFAULT_OUT
from sparse_rl_mega.data.sources import SOURCES
from sparse_rl_mega.reward import build_scorer
from sparse_rl_mega.runtime.checkpoint_files import MARKER
from sparse_rl_mega.runtime.quiet import quiet_known_warnings
from sparse_rl_mega.train.evaluation import evaluate_on_engine, scalar_items
from sparse_rl_mega.train.tracking import default_tracking_uri
from sparse_rl_mega.runtime.paths import ROOT


# SGLang 0.5.23 takes a model's context length from the first of these config.json keys, 2048 without
# any (srt/utils/hf_transformers/common.py: get_context_length)
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def parse_args(argv=None) -> argparse.Namespace:
    base = default_kv()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF model folder, or a training checkpoint (iter_* or a checkpoints folder)")
    p.add_argument("--benchmarks", required=True, help="comma-separated jsonl paths or names in --data-dir")
    p.add_argument("--data-dir", default=str(ROOT / "runs" / "data"),
                   help="where names are looked up (default: %(default)s)")
    p.add_argument("--kv", default="none",
                   help="comma-separated KV settings: none | POLICY:BUDGET (e.g. rkv:64) | rollout (--config's own) "
                        "(default: %(default)s)")
    p.add_argument("--config", default=None, help="a run config: the KV fields of its rollout.kv_compression")
    kv = p.add_argument_group(
        "KV fields of every POLICY:BUDGET setting",
        "default: --config's rollout.kv_compression, else the values shown; a flag always wins.\n"
        f"Without --config sink and window follow the budget B: window = min({base.window}, B // 4)\n"
        f"(at least 1), sink = min({base.sink}, B // 8), so that any budget >= 2 runs.")
    kv.add_argument("--interval", type=int, help=f"decode steps between compressions (N; default {base.interval})")
    kv.add_argument("--window", type=int,
                    help=f"recent window / scoring queries (w; default min({base.window}, B // 4))")
    kv.add_argument("--sink", type=int,
                    help=f"first tokens always kept (default min({base.sink}, B // 8); the published R-KV/SnapKV: 0)")
    kv.add_argument("--selection", choices=["per_layer", "per_head", "shared"],
                    help=f"a kept set per layer, per KV head, or one for every layer (the paper's release; "
                         f"default {base.selection})")
    kv.add_argument("--shared-scores", choices=["first_layer", "layer_sum"],
                    help=f"shared selection scored on the first layer (release) or all layers "
                         f"(default {base.shared_scores})")
    kv.add_argument("--trigger", choices=["length", "newline"],
                    help=f"also compress at line ends (default {base.trigger})")
    for name, flag in policy_param_flags().items():  # every registered policy's own parameters
        kv.add_argument("--" + name.replace("_", "-"), **flag)
    p.add_argument("--samples", type=int, default=1, help="samples per problem (k; default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (then --samples must be 1) (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="response length limit, capped to the model's positions minus the longest prompt "
                        "(default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark (default: all)")
    p.add_argument("--reward", default="math", choices=["math", "exact_answer"],
                   help="reward type used as the correctness check (default: %(default)s)")
    p.add_argument("--max-total-tokens", type=int, default=16384,
                   help="engine KV pool size in tokens (SGLang's own CPU default takes most of the RAM; "
                        "default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--out", default=None, help="folder for results.json and accuracy.png (default runs/eval/<time>)")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default: sqlite in --out); 'none' to skip")
    p.add_argument("--experiment", default="evaluate", help="MLflow experiment (default: %(default)s)")
    p.add_argument("--run-name", default=None)
    return p.parse_args(argv)


def check_numbers(args) -> None:
    """Raise UsageError naming the first numeric flag out of its range."""
    checks = [
        (args.samples >= 1, "--samples", f"must be >= 1, got {args.samples}"),
        (args.temperature >= 0.0, "--temperature", f"must be >= 0 (0: greedy), got {args.temperature}"),
        (args.temperature > 0.0 or args.samples == 1, "--samples",
         f"{args.samples} needs --temperature > 0 (greedy decoding gives one answer)"),
        (0.0 < args.top_p <= 1.0, "--top-p", f"must be in (0, 1], got {args.top_p}"),
        (args.max_new_tokens >= 1, "--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}"),
        (args.limit is None or args.limit >= 1, "--limit", f"must be >= 1, got {args.limit}"),
        (args.max_total_tokens >= 1, "--max-total-tokens", f"must be >= 1, got {args.max_total_tokens}"),
        (args.interval is None or args.interval >= 1, "--interval", f"must be >= 1, got {args.interval}"),
    ]
    for ok, flag, problem in checks:
        if not ok:
            raise UsageError(f"{flag}: {problem}")


def model_kind(model: str) -> str:
    """``"hf"`` for an HF model folder (config.json), ``"checkpoint"`` for a training checkpoint (an
    ``iter_*`` folder holding its marker, or a folder of them); raises UsageError otherwise."""

    path = Path(model)
    if (path / "config.json").is_file():
        return "hf"
    if (path / MARKER).is_file() or any(path.glob(f"iter_*/{MARKER}")):
        return "checkpoint"
    if not path.exists():
        raise UsageError(f"MODEL {model}: no such folder")
    raise UsageError(f"MODEL {model}: neither an HF model folder (no config.json) nor a training checkpoint "
                     f"(no {MARKER} in it or in an iter_* folder under it)")


def missing_benchmark_hint(name: str, data_dir: Path) -> str:
    """How to make the benchmark ``name`` that is not in ``data_dir``: the prepare_data.py command."""

    source, easy = (name[:-len("_easy")], " --easy") if name.endswith("_easy") else (name, "")
    out = "" if data_dir.resolve() == DEFAULT_OUT.resolve() else f" --out {data_dir}"
    if source in SOURCES:
        return f"make it with: python tools/prepare_data.py --benchmarks {source}{easy}{out}"
    return (f"tools/prepare_data.py makes {', '.join(SOURCES)} (and NAME_easy with --easy); "
            "or give a .jsonl path")


def one_line(message: str) -> str:
    """A message with a list under its first line (a DataError's bad rows) as one line: the list's
    items joined by '; '."""
    first, *items = message.splitlines()
    return " ".join([first, "; ".join(item.strip() for item in items)]) if items else first


def load_benchmarks(names: str, data_dir: Path, limit) -> dict:
    """``{name: records}`` (the first ``limit`` of each); raises UsageError naming a benchmark that is
    missing, unreadable or holds bad rows."""

    out = {}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        path = Path(name) if name.endswith(".jsonl") else data_dir / f"{name}.jsonl"
        if not path.is_file():
            hint = "give an existing .jsonl file" if name.endswith(".jsonl") else missing_benchmark_hint(name, data_dir)
            raise UsageError(f"--benchmarks {name}: {path} not found ({hint})")
        try:
            records = PromptDataset(path).records
        except OSError as exc:
            raise UsageError(f"--benchmarks {name}: cannot read {path} ({exc.strerror})") from None
        except DataError as exc:
            raise UsageError(f"--benchmarks {name}: {one_line(str(exc))}") from None
        out[path.stem] = records[:limit] if limit else records
    if not out:
        raise UsageError("--benchmarks: no benchmark given")
    return out


@dataclasses.dataclass
class Inputs:
    """What the command line names, checked: the engine's KV settings (a KVCompressionConfig), the KV
    settings to evaluate (:func:`parse_kv`) and the benchmarks' records."""
    base: object
    variants: list
    benchmarks: dict


def check_inputs(args) -> Inputs:
    """Everything that can be checked without an engine, cheapest first (torch is imported for the KV
    check); raises UsageError on the first problem."""
    check_numbers(args)
    if not args.config and "rollout" in [item.strip() for item in args.kv.split(",")]:
        raise UsageError("--kv rollout: names the KV setting of --config's run; give --config RUN.yaml")
    model_kind(args.model)
    benchmarks = load_benchmarks(args.benchmarks, Path(args.data_dir), args.limit)
    base = kv_base(args)
    return Inputs(base, parse_kv(args.kv, base, derived_fields(args)), benchmarks)


def resolve_model(model: str, workdir: Path) -> Path:
    """An HF folder as is; a training checkpoint exported to ``workdir/hf`` first."""
    path = Path(model)
    if model_kind(model) == "hf":
        return path
    out = workdir / "hf"
    print(f"[evaluate] {model} is not an HF folder: exporting it with tools/export_hf.py ...", flush=True)
    code = subprocess.call([sys.executable, str(ROOT / "tools" / "export_hf.py"), str(path), "--out", str(out)])
    if code != 0:
        raise SystemExit(f"[evaluate] could not export {model} (exit {code})")
    return out


def context_length(model_dir: Path) -> int:
    """The context length SGLang serves the model in ``model_dir`` with, read as its get_context_length
    reads it: the first of CONTEXT_LENGTH_KEYS in config.json (2048 without any), times a RoPE
    scaling factor where SGLang applies one."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # (transformers 5 serves one as the other)
    scaled = "original_max_position_embeddings" not in rope and rope.get("rope_type") != "llama3"
    factor = rope.get("factor", 1) if scaled else 1
    value = next((hf[key] for key in CONTEXT_LENGTH_KEYS if hf.get(key) is not None), 2048)
    return int(factor * value)


def fit_max_new_tokens(requested: int, context: int, pool: int, longest: tuple[int, str], log=print) -> int:
    """``requested`` capped (with a one-line notice) to what SGLang generates after the longest prompt,
    ``longest`` = ``(tokens, "file:line")``, on a model of ``context`` positions with a KV pool of
    ``pool`` slots (:func:`sparse_rl_mega.cli.preflight.response_room`); raises UsageError when SGLang would refuse that prompt."""

    tokens, where = longest
    positions = min(context, pool)
    limit = (f"the model has {context} positions" if context <= pool
             else f"the KV pool (--max-total-tokens) has {pool} slots")
    room = response_room(positions, tokens)
    if room < 1:
        raise UsageError(f"--benchmarks: the longest prompt ({where}) has {tokens} tokens and {limit}: SGLang "
                         f"takes prompts of at most {positions - 7} (leave the longer prompts out)")
    if requested > room:
        log(f"[evaluate] --max-new-tokens {requested} capped to {room}: {limit} and the longest prompt has "
            f"{tokens} tokens (SGLang generates at most positions - prompt - 2)")
    return min(requested, room)


def counted_longest(model_dir: Path, benchmarks: dict) -> tuple[int, str]:
    """``(tokens, "file:line")`` of the longest prompt, counted as the engine will receive it with the
    model's tokenizer.json (no transformers, no torch: preflight.PromptTokenCounter)."""

    counter = PromptTokenCounter(model_dir)
    return max(counter.longest([r.prompt for r in records], [r.source for r in records])
               for records in benchmarks.values())


def encode_benchmarks(tokenizer, benchmarks: dict) -> dict:
    """``{benchmark: [prompt token ids, ...]}``, as the engine is sent them."""

    return {bench: [encode_prompt(tokenizer, r.prompt) for r in records] for bench, records in benchmarks.items()}


def encoded_longest(prompts: dict, benchmarks: dict) -> tuple[int, str]:
    """``(tokens, "file:line")`` of the longest of the encoded ``prompts`` (:func:`encode_benchmarks`)."""
    return max(((len(ids), record.source) for bench, records in benchmarks.items()
                for ids, record in zip(prompts[bench], records)), key=lambda found: found[0])


def evaluate(model_dir: Path, tokenizer, prompts: dict, benchmarks: dict, variants: list, base, args,
             log=print) -> dict:
    """Decode every benchmark (``prompts``: token ids, ``benchmarks``: the records with their labels)
    under every KV setting on one engine (started with ``base``'s settings, a KVCompressionConfig,
    taking any other per request); returns nested results."""
    from sparse_rl_mega.rollout.engine import RolloutEngine
    from sparse_rl_mega.rollout.engine_args import engine_kv_settings

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
                    engine, prompts[bench], [r.label for r in records], scorer, variants, n_samples=args.samples,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    seed=args.seed, log=log, name=f"evaluate {bench}")
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


def run(args, inputs: Inputs) -> Path:
    """Evaluate the checked ``inputs``; returns the folder of results.json and accuracy.png."""
    from sparse_rl_mega.rollout.engine_processes import preload_cpu_engines

    out = Path(args.out or ROOT / "runs" / "eval" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="evaluate-", dir=out) as workdir:
        model_dir = resolve_model(args.model, Path(workdir))
        context, pool = context_length(model_dir), args.max_total_tokens
        # before SGLang is imported (seconds): a prompt too long for the model fails at once
        args.max_new_tokens = fit_max_new_tokens(args.max_new_tokens, context, pool,
                                                 counted_longest(model_dir, inputs.benchmarks))
        preload_cpu_engines()  # SGLang imported once, its processes forked from here (rollout/forkserver.py)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = encode_benchmarks(tokenizer, inputs.benchmarks)
        # the ids the engine is sent: a second notice only if they are longer than counted
        args.max_new_tokens = fit_max_new_tokens(args.max_new_tokens, context, pool,
                                                 encoded_longest(prompts, inputs.benchmarks))
        results = evaluate(model_dir, tokenizer, prompts, inputs.benchmarks, inputs.variants, inputs.base, args)
    # the capped --max-new-tokens is what results.json records
    (out / "results.json").write_text(json.dumps({"model": args.model, "args": vars(args), "results": results},
                                                 indent=2))
    plot(results, args.samples, out / "accuracy.png")
    log_to_mlflow(results, args, out)
    print(table(results, args.samples))
    return out


def main(argv=None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (its OpenMP pool: one thread)
    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/runtime/quiet.py
    args = parse_args(argv)
    try:
        out = run(args, check_inputs(args))
    except UsageError as exc:
        print(f"evaluate.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"[evaluate] results in {out} (results.json, accuracy.png)")
    return 0

