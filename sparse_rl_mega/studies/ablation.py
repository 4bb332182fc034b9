"""Train the same config under several rollout/correction variants and compare them side by side.

    python tools/ablation.py examples/cpu_smollm2.yaml                       # naive, sparse_rl, dense
    python tools/ablation.py examples/cpu_tiny.yaml --variants naive,sparse_rl,tis --iterations 5
    python tools/ablation.py examples/cpu_smollm2_tight_kv.yaml --budgets 32,44,56 --auto sparse_rl   # budget map
    python tools/ablation.py examples/cpu_long_chain.yaml --seeds 1,2,3       # three seeds per variant

Variants (same seed, data, prompts order and sampling seeds; only what the variant names changes):

  naive      sparse (KV-compressed) rollouts, no correction: PPO anchored at the dense pi_old
  sparse_rl  sparse rollouts with the paper's rejection and importance reweighting
  dense      rollouts without KV compression (rollout.kv_compression.policy: none), correction as in CONFIG
  tis, icepop, bypass    sparse rollouts with that correction preset (docs/algorithm.md)

When the config evaluates (``eval.path``), every variant is evaluated under dense decoding and under
the rollout's own compression (``eval.kv`` = ``dense,POLICY:BUDGET`` of CONFIG's ``kv_compression``,
the dense variant included: its compressed evaluation uses every other field of that section), and
the summary gives each its ratio to the dense-trained model and the drop from dense to sparse decoding.

``--budgets B1,B2,...`` sweeps the KV budget: every sparse variant runs once per budget (``naive_b32``, ...;
the dense variant once, evaluated under each budget's compression) and ``--auto V1,...`` runs those
variants once more with the automatic budget within the sweep's bounds (``sparse_rl_auto``; it starts at
the largest, the safe end; the other auto_budget fields may be --set). The tool then also draws
``OUT/budget_map.png``: held-out accuracy as a fraction of the dense variant's against the rollouts' mean
peak KV per sample as a fraction of dense, a curve per variant, the automatic runs as points.

Each variant is one ``tools/launch.py`` run into ``OUT/<variant>`` (on a CPU node a fork of this process,
which imported the launcher's modules once: sparse_rl_mega/cli/launches.py); all log to one MLflow store
(``OUT/mlflow.db``, experiment ``ablation``, run name = variant). The tool then writes
``OUT/ablation.png`` (reward, mismatch k3, token rejection by side, quantiles of log rho, the largest
importance weight, evicted tokens and held-out accuracy with its standard error; with --seeds a line per
variant, its mean over seeds with +- 1 s.e. across them), ``OUT/ablation.md`` (a table of the training metrics and
one of the final held-out accuracies: per KV setting, the ratio to the dense variant's and the drop
from dense decoding, each with its paired standard error) and ``OUT/ablation.json``, and logs them as a
summary run. Every variant's config is validated before the first one starts. A variant that already
finished in OUT (its MLflow run ended with every iteration logged) is not run again unless --rerun:
re-running the command after an interruption continues with the variants still missing, and
``--report`` writes the summary of those finished so far without launching anything (a long sweep can be
looked at while it runs, or after it was cut short).

``--seeds S1,S2,...`` runs every variant once per seed (``trainer.seed``: the rollouts' sampling seeds;
``data.seed``: the prompts' order), as ``VARIANT_s<S>``, seed after seed (a study cut short has whole
seeds, and re-running the command continues it); each run's held-out ratio is taken against the dense
variant of its own seed, and the summary adds a table of means over seeds with their standard errors
across seeds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from sparse_rl_mega.cli.launches import run_launch, start_launch_server
from sparse_rl_mega.config import CORRECTION_PRESETS, ConfigError, load_config
from sparse_rl_mega.studies.plots import plot, plot_budget_map
from sparse_rl_mega.studies.run_store import EXPERIMENT, collect, finished
from sparse_rl_mega.studies.statistics import metric_name, summarize
from sparse_rl_mega.runtime.quiet import quiet_known_warnings
from sparse_rl_mega.runtime.paths import ROOT

AUTO_KEY = "rollout.kv_compression.auto_budget"


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
    p.add_argument("--report", action="store_true",
                   help="launch nothing: summarise the variants finished in --out so far")
    p.add_argument("--budgets", default=None, metavar="B1,B2,...",
                   help="run every sparse variant once per KV budget (the budget map); dense runs once")
    p.add_argument("--auto", default=None, metavar="V1,...",
                   help="with --budgets: also run these variants with the automatic budget within the sweep's bounds")
    p.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="run every variant once per seed (trainer.seed and data.seed: sampling and data order), "
                        "named VARIANT_s<S>; the summary adds means over seeds with their standard errors")
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
    budgets = parse_budgets(getattr(args, "budgets", None))
    # (the user's --set of auto_budget fields, e.g. decrease, is read with the sweep's bounds)
    bounds = [f"{AUTO_KEY}.min={budgets[0]}", f"{AUTO_KEY}.max={budgets[-1]}",
              f"rollout.kv_compression.budget={budgets[-1]}"] if getattr(args, "auto", None) and len(budgets) > 1 else []
    base = load_config(args.config, [*args.overrides, *bounds])  # raises ConfigError naming the key
    kv = base.rollout.kv_compression
    for name, variant, overrides in with_seeds(expand_variants(args, names, kv, base.eval.path is not None),
                                               parse_seeds(getattr(args, "seeds", None))):
        overrides = [*filter(None, overrides[:1]), *args.overrides, *variant_overrides(variant), *overrides[1:],
                     f"trainer.run_dir={out / name}",
                     f"tracking.tracking_uri={tracking}", f"tracking.experiment={EXPERIMENT}",
                     f"tracking.run_name={name}", "tracking.enabled=true"]
        if args.iterations is not None:
            overrides.append(f"trainer.iterations={args.iterations}")
        cfg = load_config(args.config, overrides)  # raises ConfigError naming the key
        if variant != "dense" and cfg.rollout.kv_compression.policy == "none":
            raise ValueError(f"variant {name}: {args.config} has no KV compression "
                             "(rollout.kv_compression.policy: none), so it would equal 'dense'")
        runs[name] = overrides
        iterations[name] = cfg.trainer.iterations
    return out, runs, iterations


def parse_budgets(spec: Optional[str]) -> list[int]:
    budgets = [b.strip() for b in (spec or "").split(",") if b.strip()]
    if spec is not None and (not budgets or not all(b.isdigit() and int(b) > 0 for b in budgets)
                             or len(set(budgets)) != len(budgets)):
        raise ValueError(f"--budgets {spec!r}: expected distinct positive integers, e.g. 32,44,56")
    return sorted(int(b) for b in budgets)


def parse_seeds(spec: Optional[str]) -> list[int]:
    seeds = [x.strip() for x in (spec or "").split(",") if x.strip()]
    if spec is not None and (not seeds or not all(x.isdigit() for x in seeds) or len(set(seeds)) != len(seeds)):
        raise ValueError(f"--seeds {spec!r}: expected distinct non-negative integers, e.g. 1,2,3")
    return [int(x) for x in seeds]


def with_seeds(runs: list[tuple[str, str, list[str]]], seeds: list[int]) -> list[tuple[str, str, list[str]]]:
    """Every run once per seed (seed-major: a study cut short has whole seeds), ``NAME_s<seed>`` with
    ``trainer.seed`` (sampling) and ``data.seed`` (data order) set; the runs as they are without seeds."""
    if not seeds:
        return runs
    return [(f"{name}_s{seed}", variant, [*overrides, f"trainer.seed={seed}", f"data.seed={seed}"])
            for seed in seeds for name, variant, overrides in runs]


def expand_variants(args, names: list[str], kv, evaluates: bool) -> list[tuple[str, str, list[str]]]:
    """``(run name, variant, overrides)`` of every run: the variants as given, or with ``--budgets``
    each sparse variant once per budget and ``--auto`` ones once more with the automatic budget. The
    first override is the evaluation's KV settings ("" when the config does not evaluate), which the
    user's --set may replace; the others come after the user's."""
    budgets = parse_budgets(getattr(args, "budgets", None))
    auto = [n.strip() for n in (getattr(args, "auto", None) or "").split(",") if n.strip()]
    if budgets and kv.auto_budget is not None:
        kv = dataclasses.replace(kv, budget=budgets[-1])  # (the evaluations name budgets, never 'auto')
    if auto and len(budgets) < 2:
        raise ValueError("--auto needs --budgets with at least two budgets: its bounds are their min and max")
    if set(auto) - set(names) or "dense" in auto:
        raise ValueError(f"--auto {args.auto!r}: name sparse variants of --variants ({args.variants})")
    if kv.policy == "none" and budgets:
        raise ValueError(f"--budgets: {args.config} has no KV compression (rollout.kv_compression.policy: none)")

    def evaluation(*settings: str) -> list[str]:
        return [f"eval.kv={','.join(('dense',) + settings)}" if evaluates and kv.policy != "none" else ""]
    if not budgets:
        return [(name, name, [*evaluation(f"{kv.policy}:{kv.budget}"), f"{AUTO_KEY}=null"]
                 if kv.auto_budget is None or name == "dense" else evaluation("rollout"))
                for name in names]
    fixed = [f"{AUTO_KEY}=null"]
    out = []
    for name in names:
        if name == "dense":  # once, evaluated under every budget's compression (the ratios' denominators)
            out.append((name, name, [*evaluation(*[f"{kv.policy}:{b}" for b in budgets]), *fixed]))
            continue
        if name in auto:  # first: a sweep cut short still places the run a user would make against the others
            low, high = budgets[0], budgets[-1]
            out.append((f"{name}_auto", name, [*evaluation("rollout"), f"{AUTO_KEY}.min={low}", f"{AUTO_KEY}.max={high}",
                                               f"rollout.kv_compression.budget={high}"]))  # the safe end
        for b in budgets:
            out.append((f"{name}_b{b}", name, [*evaluation(f"{kv.policy}:{b}"), *fixed,
                                               f"rollout.kv_compression.budget={b}"]))
    return out


def main(argv=None) -> int:

    # before torch is imported: the launches' server is forked from this process, and torch's OpenMP pool
    # must not have started threads in it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/runtime/quiet.py
    args = parse_args(argv)
    try:
        out, runs, iterations = plan(args)
    except (ConfigError, ValueError) as exc:
        print(f"ablation: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    # the launches: forks of one process that imported the launcher's modules (CPU, one node), else new
    # interpreters; started before MLflow's store, which starts a thread here
    forked = None if args.report else start_launch_server(args.config, next(iter(runs.values())))
    tracking = args.tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    mlflow.set_tracking_uri(tracking)
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:  # artifacts beside the store, not in the cwd
        mlflow.create_experiment(EXPERIMENT, artifact_location=(out / "mlartifacts").as_uri()
                                 if args.tracking_uri is None else None)
    print(f"[ablation] {len(runs)} variant(s): {', '.join(runs)} -> {out}", flush=True)
    failed, missing = [], []
    for k, (name, overrides) in enumerate(runs.items(), 1):
        if args.report:
            if not finished(tracking, name, iterations[name]):
                missing.append(name)
            continue
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

    if missing:
        print(f"[ablation] --report: not finished in {out}, left out: {', '.join(missing)}", flush=True)
    data = collect(tracking, [name for name in runs if name not in missing], out)
    if not data:
        print("[ablation] no variant produced metrics", file=sys.stderr)
        return 1
    rows, accuracy, table = summarize(data)
    (out / "ablation.md").write_text(table + "\n")
    (out / "ablation.json").write_text(json.dumps({"config": str(args.config), "overrides": args.overrides,
                                                   "rows": rows, "held_out": accuracy, "variants": data}, indent=2))
    plot(data, out / "ablation.png")
    outputs = ["ablation.md", "ablation.json", "ablation.png"]
    if args.budgets and plot_budget_map(rows, accuracy, out / "budget_map.png"):
        outputs.append("budget_map.png")

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
        for name in outputs:
            mlflow.log_artifact(str(out / name))
    print(table)
    print(f"[ablation] results in {out} ({', '.join(outputs)}; MLflow {tracking})")
    if failed:
        print(f"[ablation] failed variant(s): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0

