"""The overlap benchmark's layout and figures (``tools/bench_overlap.py``, the overlap tests): one learner
rank beside one separate engine, and each run's means over its iterations after the first."""
from __future__ import annotations

import statistics
from pathlib import Path

from sparse_rl_mega.train.run_records import metrics_by_iteration

# the layout the benchmark runs by default: one learner rank, one separate engine, weights by broadcast
SEPARATE = ["parallel.nproc_per_node=1", "parallel.pipeline_model_parallel_size=1", "rollout.placement=separate",
            "trainer.sync_method=broadcast", "checkpoint.save_interval=0"]



def run_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Every metric of the run folder's MLflow store, by iteration (0-based)."""
    return metrics_by_iteration(run_dir, skip=())


def summarize(runs: list[dict[int, dict[str, float]]]) -> dict[str, float]:
    """Means over every run's iterations after the first."""
    rows = [m for metrics in runs for step, m in sorted(metrics.items()) if step > 0]
    half = [m for metrics in runs for step, m in sorted(metrics.items()) if step >= len(metrics) // 2]

    def mean(key, of=rows):
        return statistics.fmean(m.get(key, 0.0) for m in of)

    def mean_present(key):  # over the iterations that report it (NaN: none)
        values = [m[key] for m in rows if key in m]
        return statistics.fmean(values) if values else float("nan")
    return {
        "iteration_s": mean("time/iteration_s"),
        "learner_wait_s": mean("time/learner_wait_s"),
        "engine_idle_s": mean("time/engine_idle_s"),
        "generate_s": mean("time/generate_s"),
        "learner_compute_s": mean("time/logp_old_s") + mean("time/train_s"),
        "sync_s": mean("time/sync_s"),
        "samples_per_s": mean("rollout/samples") / mean("time/iteration_s"),
        "staleness_mean": mean("rollout/staleness_mean"),
        "token_staleness_mean": mean("rollout/token_staleness_mean"),
        "multi_version_fraction": mean("rollout/multi_version_fraction"),
        "paused_generations": mean("sync/paused_generations"),
        "k3": mean("mismatch/k3"),
        "k3_resumed": mean_present("mismatch/k3_resumed"),
        "reward_mean": mean("reward/mean", [m for metrics in runs for m in metrics.values()]),
        "reward_mean_second_half": mean("reward/mean", half),
        "iterations_timed": float(len(rows)),
    }
