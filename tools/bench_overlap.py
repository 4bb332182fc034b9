#!/usr/bin/env python
"""Overlapped and partial rollouts: iteration time with ``rollout.max_staleness`` K = 1 (the engines
generate the next batch while the learner trains) beside K = 0 (generate, train, push in turn), and with
partial rollouts (``K:stale``, ``K:reprefill``: a push pauses the requests in flight instead of waiting
for them, ``rollout.partial``), same config.

Launches ``tools/launch.py CONFIG`` once per variant (alternating when ``--repeats`` > 1; on a CPU node each a
fork of this process, which imported the launcher's modules once: sparse_rl_mega/cli/launches.py), each in
its own run folder, then reads the runs' MLflow metrics and ``timeline.jsonl``. Per K, means over the iterations
after the first (its rollout includes the engine's warm-up): iteration time, the learner's wait for
samples (``time/learner_wait_s``), the engine's idle time before each batch (``time/engine_idle_s``),
its generation time, the learner's compute (dense ``logp_old`` + optimizer steps), the weight push,
samples per second, the samples' and tokens' staleness, the samples that span several weight versions,
the mismatch (k3) of all tokens and of the tokens sampled after a pause, and the training reward; ratios
against the first variant last. ``--json`` writes it all; each launch's output is kept beside its run
folder (``<out>/k<K>[-<partial>]_r<repeat>.log``).

Default: examples/cpu_tiny.yaml with one learner process and one separate engine (2 processes on the
2 cores here), the example's R-KV sampling, no checkpoints:

    python tools/bench_overlap.py --iterations 12 --repeats 2 --json runs/bench_overlap.json

Long-tailed response lengths (examples/cpu_long_tail.yaml), each partial-rollout KV choice:

    python tools/bench_overlap.py examples/cpu_long_tail.yaml --staleness 1,1:stale,1:reprefill
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# before torch is imported (by the package below): the launches' server is forked from this process, and
# torch's OpenMP pool must not have started threads in it
os.environ.setdefault("OMP_NUM_THREADS", "1")

import _bootstrap  # noqa: E402, F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.cli.launches import run_launch, start_launch_server  # noqa: E402
from sparse_rl_mega.studies.overlap import SEPARATE, run_metrics, summarize  # noqa: E402

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(ROOT / "examples" / "cpu_tiny.yaml"),
                   help="run config (default: examples/cpu_tiny.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable), after the defaults below")
    p.add_argument("--no-separate", action="store_true",
                   help=f"keep the config's layout instead of {' '.join(SEPARATE)}")
    p.add_argument("--staleness", default="0,1", metavar="K[:PARTIAL],...",
                   help="the variants, comma-separated: rollout.max_staleness K, with rollout.partial after a colon "
                        "(stale or reprefill); default 0,1")
    p.add_argument("--iterations", type=int, default=12, help="trainer.iterations of each run")
    p.add_argument("--repeats", type=int, default=1, help="runs per value, alternating; figures pooled")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_overlap"), help="parent of the run folders")
    p.add_argument("--json", default=None, help="write all figures here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    values = args.staleness.split(",")
    for value in values:
        k, _, partial = value.partition(":")
        if not k.isdigit() or partial not in ("", "stale", "reprefill"):
            print(f"[bench] --staleness: {value!r} is not K or K:stale or K:reprefill", file=sys.stderr)
            return 2

    def settings(value: str) -> list[str]:
        k, _, partial = value.partition(":")
        return [f"rollout.max_staleness={k}", f"rollout.partial={partial or 'none'}"]
    base = ([] if args.no_separate else SEPARATE) + [f"trainer.iterations={args.iterations}"] + args.overrides
    runs: dict[str, list] = {k: [] for k in values}
    # the launches: forks of one process that imported the launcher's modules (CPU, one node), else new
    # interpreters (start-up is not timed: the figures come from the runs' iterations)
    forked = start_launch_server(args.config, base + settings(values[0]))
    for repeat in range(args.repeats):
        for k in values:
            run_dir = Path(args.out) / f"k{k.replace(':', '-')}_r{repeat}"
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            sets = base + settings(k) + [f"trainer.run_dir={run_dir}"]
            print(f"[bench] {' '.join(settings(k))} run {repeat + 1}/{args.repeats} -> {run_dir}", flush=True)
            log = run_dir.with_name(f"{run_dir.name}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            if run_launch([args.config, *[f"--set={s}" for s in sets]], log=log, cwd=ROOT, forked=forked) != 0:
                print(log.read_text(errors="replace")[-5000:], file=sys.stderr)
                return 1
            runs[k].append(run_metrics(run_dir))
    figures = {k: summarize(r) for k, r in runs.items()}
    for k, f in figures.items():
        print(" ".join(f"k{k}_{name}={value:.4g}" for name, value in f.items()))
    reference, first = figures[values[0]], values[0]
    for k in values[1:]:
        f = figures[k]
        print(f"ratio_iteration_s_k{first}_over_k{k}={reference['iteration_s'] / f['iteration_s']:.3f} "
              f"ratio_samples_per_s_k{k}_over_k{first}={f['samples_per_s'] / reference['samples_per_s']:.3f} "
              f"ratio_learner_wait_s_k{first}_over_k{k}={reference['learner_wait_s'] / max(f['learner_wait_s'], 1e-9):.3g} "
              f"ratio_engine_idle_s_k{first}_over_k{k}={reference['engine_idle_s'] / max(f['engine_idle_s'], 1e-9):.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": args.config, "overrides": base, "figures": figures},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
