#!/usr/bin/env python
"""Train the same config under several rollout/correction variants and compare them side by side.

    python tools/ablation.py examples/cpu_smollm2.yaml                       # naive, sparse_rl, dense
    python tools/ablation.py examples/cpu_tiny.yaml --variants naive,sparse_rl,tis --iterations 5

Variants (same seed, data, prompts order and sampling seeds; only what the variant names changes):

  naive      sparse (KV-compressed) rollouts, no correction: PPO anchored at the dense pi_old
  sparse_rl  sparse rollouts with the paper's rejection and importance reweighting
  dense      rollouts without KV compression (rollout.kv_compression.policy: none), correction as in CONFIG
  tis, icepop, bypass    sparse rollouts with that correction preset (docs/algorithm.md)

When the config evaluates (``eval.path``), every variant is evaluated under dense decoding and under
the rollout's own compression (``eval.kv`` = ``dense,POLICY:BUDGET`` of CONFIG's ``kv_compression``,
the dense variant included: its compressed evaluation uses every other field of that section), and
the summary gives each its ratio to the dense-trained model and the drop from dense to sparse decoding.

Each variant is one ``tools/launch.py`` run into ``OUT/<variant>`` (on a CPU node a fork of this process,
which imported the launcher's modules once: sparse_rl_mega/launches.py); all log to one MLflow store
(``OUT/mlflow.db``, experiment ``ablation``, run name = variant). The tool then writes
``OUT/ablation.png`` (reward, mismatch k3, token rejection by side, quantiles of log rho, the largest
importance weight, evicted tokens and held-out accuracy with its standard error), ``OUT/ablation.md`` (a table of the training metrics and
one of the final held-out accuracies: per KV setting, the ratio to the dense variant's and the drop
from dense decoding, each with its paired standard error) and ``OUT/ablation.json``, and logs them as a
summary run. Every variant's config is validated before the first one starts. A variant that already
finished in OUT (its MLflow run ended with every iteration logged) is not run again unless --rerun:
re-running the command after an interruption continues with the variants still missing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sparse_rl_mega.config import CORRECTION_PRESETS, ConfigError, load_config  # noqa: E402
from sparse_rl_mega.launches import run_launch, start_launch_server  # noqa: E402

EXPERIMENT = "ablation"
# (axis title, [(metric, line label)]) per panel; the last panel is held-out accuracy when the config evaluates
PANELS = [("training reward", [("reward/mean", "")]),
          ("mismatch k3 (dense vs sparse sampler)", [("mismatch/k3", "")]),
          ("tokens rejected: all, rho < 1 (low), rho > 1 (high)",
           [("correction/token_rejected_fraction", ""), ("correction/token_rejected_low_fraction", " low"),
            ("correction/token_rejected_high_fraction", " high")]),
          ("log rho over response tokens: p1, p5, p50",
           [("mismatch/log_rho_p1", " p1"), ("mismatch/log_rho_p5", " p5"), ("mismatch/log_rho_p50", " p50")]),
          ("largest importance weight (their mean is 1)", [("correction/is_weight_max", "")]),
          ("evicted tokens per sample", [("kv/evicted_tokens_per_sample", "")])]
CURVES = [key for _, lines in PANELS for key, _ in lines]


def variant_overrides(name: str) -> list[str]:
    """The config overrides that make variant ``name``."""
    if name == "dense":
        return ["rollout.kv_compression.policy=none"]
    if name in CORRECTION_PRESETS and name != "custom":
        return [f"algorithm.correction.preset={name}"]
    raise ValueError(f"unknown variant {name!r}; expected dense or a correction preset: "
                     f"{', '.join(p for p in CORRECTION_PRESETS if p != 'custom')}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ablation.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML run config (e.g. examples/cpu_smollm2.yaml)")
    p.add_argument("--variants", default="naive,sparse_rl,dense", help="comma-separated (default: %(default)s)")
    p.add_argument("--iterations", type=int, default=None, help="trainer.iterations for every variant")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: runs/ablation/<time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every variant (repeatable)")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default: sqlite in --out)")
    p.add_argument("--rerun", action="store_true", help="run variants again even if they finished in --out")
    return p.parse_args(argv)


def plan(args) -> tuple[Path, dict[str, list[str]], dict[str, int]]:
    """Validate every variant's config; returns the output folder, each variant's overrides and
    iterations."""
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--variants {args.variants!r}: give distinct variant names")
    if args.iterations is not None and args.iterations <= 0:
        raise ValueError(f"--iterations must be > 0, got {args.iterations}")
    out = (args.out or ROOT / "runs" / "ablation" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    tracking = args.tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    runs, iterations = {}, {}
    base = load_config(args.config, args.overrides)  # raises ConfigError naming the key
    kv = base.rollout.kv_compression
    evaluated = []  # every variant dense and under the rollout's compression (the user's --set wins)
    if base.eval.path is not None and kv.policy != "none":
        evaluated = [f"eval.kv=dense,{kv.policy}:{kv.budget}"]
    for name in names:
        overrides = [*evaluated, *args.overrides, *variant_overrides(name), f"trainer.run_dir={out / name}",
                     f"tracking.tracking_uri={tracking}", f"tracking.experiment={EXPERIMENT}",
                     f"tracking.run_name={name}", "tracking.enabled=true"]
        if args.iterations is not None:
            overrides.append(f"trainer.iterations={args.iterations}")
        cfg = load_config(args.config, overrides)  # raises ConfigError naming the key
        if name != "dense" and cfg.rollout.kv_compression.policy == "none":
            raise ValueError(f"variant {name}: {args.config} has no KV compression "
                             "(rollout.kv_compression.policy: none), so it would equal 'dense'")
        runs[name] = overrides
        iterations[name] = cfg.trainer.iterations
    return out, runs, iterations


def latest_run(client, name: str):
    """The newest MLflow run of variant ``name`` in the ablation experiment, or None."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def finished(tracking_uri: str, name: str, iterations: int) -> bool:
    """Whether variant ``name`` already has a finished run in the store with all ``iterations`` logged."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    run = latest_run(client, name)
    return run is not None and run.info.status == "FINISHED" and \
        len(client.get_metric_history(run.info.run_id, "reward/mean")) == iterations


def collect(tracking_uri: str, names: list[str], out: Path) -> dict[str, dict]:
    """Per variant: metric histories (step -> value) and the trainer's held-out evaluations."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    data: dict[str, dict] = {}
    for name in names:
        run = latest_run(client, name)
        if run is None:
            continue
        run_id = run.info.run_id
        curves = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in CURVES}
        eval_file = out / name / "eval.json"
        evals = json.loads(eval_file.read_text())["history"] if eval_file.is_file() else []
        data[name] = {"run_id": run_id, "curves": curves, "eval": evals}
    return data


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def ratio_with_stderr(numerator: list[float], denominator: list[float]) -> tuple[float, float]:
    """``mean(numerator) / mean(denominator)`` of paired per-problem accuracies (same problems, same
    order) and its standard error by the delta method: ``sd(x - r y) / (sqrt(n) mean(y))``."""
    n = len(numerator)
    if n != len(denominator) or n < 2:
        raise ValueError(f"need two paired lists of >= 2 problems, got {n} and {len(denominator)}")
    mean_x, mean_y = sum(numerator) / n, sum(denominator) / n
    if mean_y == 0:
        return float("nan"), float("nan")
    ratio = mean_x / mean_y
    residuals = [x - ratio * y for x, y in zip(numerator, denominator)]
    variance = sum(r * r for r in residuals) / (n - 1)  # the residuals have mean 0
    return ratio, (variance / n) ** 0.5 / mean_y


def per_problem(evaluation: dict, label: str) -> list[float]:
    """Per-problem accuracy (correct / samples) of one evaluation entry."""
    row = evaluation["results"][label]
    return [c / row["samples_per_problem"] for c in row["correct_per_problem"]]


def difference_with_stderr(x: list[float], y: list[float]) -> tuple[float, float]:
    """``mean(x - y)`` of paired per-problem accuracies and its standard error (over problems)."""
    from sparse_rl_mega.evaluation import mean_stderr

    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two paired lists of >= 2 problems, got {len(x)} and {len(y)}")
    diffs = [a - b for a, b in zip(x, y)]
    return sum(diffs) / len(diffs), mean_stderr(diffs)


def metric_name(label: str) -> str:
    """A KV setting's label as MLflow accepts it in a metric name (``rkv:32`` -> ``rkv_32``)."""
    return label.replace(":", "_")


def held_out(data: dict[str, dict]) -> list[dict]:
    """Per variant and KV setting of its last evaluation: accuracy before and after with standard
    errors, the ratio to the dense variant's accuracy under the same setting (paired over problems)
    and the drop from the variant's own dense decoding (dense minus this setting)."""
    rows = []
    dense_run = data.get("dense", {}).get("eval")
    for name, d in data.items():
        if not d["eval"]:
            continue
        first, last = d["eval"][0], d["eval"][-1]
        for label, result in last["results"].items():
            row = {"variant": name, "setting": label, "iterations": last["iteration"],
                   "before": first["results"].get(label, {}).get("mean_at_k", float("nan"))
                   if first["iteration"] == 0 else float("nan"),  # (eval.before_training: false)
                   "after": result["mean_at_k"], "after_stderr": result.get("mean_at_k_stderr", float("nan"))}
            paired = "correct_per_problem" in result
            if paired and name != "dense" and dense_run and dense_run[-1]["iteration"] == last["iteration"] \
                    and label in dense_run[-1]["results"]:
                row["ratio_to_dense"], row["ratio_stderr"] = ratio_with_stderr(
                    per_problem(last, label), per_problem(dense_run[-1], label))
            if paired and label != "dense" and "dense" in last["results"]:
                row["drop_from_dense"], row["drop_stderr"] = difference_with_stderr(
                    per_problem(last, "dense"), per_problem(last, label))
            rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row.get(k, float('nan')):.3f}" if isinstance(row.get(k), float)
                                       else str(row.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def summarize(data: dict[str, dict]) -> tuple[list[dict], list[dict], str]:
    """One row per variant (training metrics), one per variant and KV setting (held-out accuracy),
    and markdown tables of them."""
    rows = []
    for name, d in data.items():
        reward = d["curves"]["reward/mean"]
        steps = sorted(reward)
        tail = steps[-max(1, len(steps) // 3):]  # the last third of the run
        row = {"variant": name, "iterations": len(steps),
               "reward_first": reward[steps[0]] if steps else float("nan"),
               "reward_last_third": _mean(reward[s] for s in tail),
               "k3_mean": _mean(d["curves"]["mismatch/k3"].values()),
               "token_rejected_mean": _mean(d["curves"]["correction/token_rejected_fraction"].values()),
               "token_rejected_low_mean": _mean(d["curves"]["correction/token_rejected_low_fraction"].values()),
               "is_weight_max_mean": _mean(d["curves"]["correction/is_weight_max"].values())}
        rows.append(row)
    accuracy = held_out(data)
    table = _table(rows) + ("\n\nHeld-out mean@k after the last iteration, +- s.e. over problems (ratios and "
                           "drops paired over the same problems):\n\n" + _table(accuracy) if accuracy else "")
    return rows, accuracy, table


def plot(data: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_eval = any(d["eval"] for d in data.values())
    panels = len(PANELS) + int(has_eval)
    columns = min(panels, 3)
    rows = -(-panels // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(4.4 * columns, 3.3 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.set_visible(False)
    axes = axes[:panels]
    styles = ["-", "--", ":"]
    for ax, (title, lines) in zip(axes, PANELS):
        for k, name in enumerate(data):
            for (key, suffix), style in zip(lines, styles):
                points = sorted(data[name]["curves"][key].items())
                if not points:  # (a run logged before the metric existed)
                    continue
                ax.plot([s + 1 for s, _ in points], [v for _, v in points], marker="o", markersize=3,
                        linestyle=style, color=f"C{k}", label=name + suffix)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
    if has_eval:
        ax = axes[-1]
        for k, (name, d) in enumerate(data.items()):
            labels = list(d["eval"][-1]["results"]) if d["eval"] else []
            for label in labels:
                points = [(h["iteration"], h["results"][label]) for h in d["eval"] if label in h["results"]]
                ax.errorbar([i for i, _ in points], [r["mean_at_k"] for _, r in points],
                            yerr=[r.get("mean_at_k_stderr", 0.0) for _, r in points], marker="o", markersize=3,
                            capsize=2, linestyle="-" if label == "dense" else "--", color=f"C{k}",
                            label=f"{name} ({label})")
        ax.set_title("held-out accuracy, mean@k +- 1 s.e. (dense decoding -)", fontsize=9)
        ax.set_xlabel("iterations trained")
        ax.set_ylim(0, 1)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from sparse_rl_mega.quiet import quiet_known_warnings

    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/quiet.py
    args = parse_args(argv)
    try:
        out, runs, iterations = plan(args)
    except (ConfigError, ValueError) as exc:
        print(f"ablation: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    # the launches: forks of one process that imported the launcher's modules (CPU, one node), else new
    # interpreters; started before MLflow's store, which starts a thread here
    forked = start_launch_server(args.config, next(iter(runs.values())))
    tracking = args.tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    mlflow.set_tracking_uri(tracking)
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:  # artifacts beside the store, not in the cwd
        mlflow.create_experiment(EXPERIMENT, artifact_location=(out / "mlartifacts").as_uri()
                                 if args.tracking_uri is None else None)
    print(f"[ablation] {len(runs)} variant(s): {', '.join(runs)} -> {out}", flush=True)
    failed = []
    for k, (name, overrides) in enumerate(runs.items(), 1):
        if not args.rerun and finished(tracking, name, iterations[name]):
            print(f"[ablation] ({k}/{len(runs)}) {name}: finished in {out} already (--rerun runs it again)",
                  flush=True)
            continue
        started = time.perf_counter()
        print(f"[ablation] ({k}/{len(runs)}) {name}: tools/launch.py {args.config} "
              + " ".join(f"--set {o}" for o in overrides if o not in args.overrides), flush=True)
        # (a run that did not finish is run again from its start: its checkpoints go first)
        code = run_launch([args.config, *[f"--set={o}" for o in overrides], "--overwrite"], forked=forked)
        print(f"[ablation] {name}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(name)

    data = collect(tracking, list(runs), out)
    if not data:
        print("[ablation] no variant produced metrics", file=sys.stderr)
        return 1
    rows, accuracy, table = summarize(data)
    (out / "ablation.md").write_text(table + "\n")
    (out / "ablation.json").write_text(json.dumps({"config": str(args.config), "overrides": args.overrides,
                                                   "rows": rows, "held_out": accuracy, "variants": data}, indent=2))
    plot(data, out / "ablation.png")

    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_name="summary"):
        mlflow.log_params({"config": str(args.config), "variants": ",".join(runs)})
        for row in rows:
            for key, value in row.items():
                if isinstance(value, float):
                    mlflow.log_metric(f"{row['variant']}/{key}", value)
        for row in accuracy:
            for key, value in row.items():
                if isinstance(value, float):
                    mlflow.log_metric(f"{row['variant']}/eval_{metric_name(row['setting'])}/{key}", value)
        for name in ("ablation.md", "ablation.json", "ablation.png"):
            mlflow.log_artifact(str(out / name))
    print(table)
    print(f"[ablation] results in {out} (ablation.md, ablation.png, ablation.json; MLflow {tracking})")
    if failed:
        print(f"[ablation] failed variant(s): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
