"""The statistics of a study (``tools/ablation.py``): variants and their seeds, held-out accuracy with
standard errors (paired over problems, and across seeds), the ratio to the dense variant, training
metrics over a run, the curves' means across seeds, and the markdown tables of them. ``data`` maps a
run's name to ``{"curves": {metric: {step: value}}, "eval": [evaluation, ...]}`` (as the tool collects
them from MLflow and the run folders)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from sparse_rl_mega.train.evaluation import mean_stderr

Row = dict[str, Any]  # a table row: a variant (and setting) and its figures
Runs = dict[str, dict[str, Any]]  # run name -> {"curves": ..., "eval": [...]}


def split_seed(name: str) -> tuple[str, Optional[int]]:
    """``sparse_rl_b32_s2`` -> ``("sparse_rl_b32", 2)``; a name without a seed -> ``(name, None)``."""
    head, _, tail = name.rpartition("_s")
    return (head, int(tail)) if head and tail.isdigit() else (name, None)


def base_variant(name: str) -> str:
    """``sparse_rl_b32`` / ``sparse_rl_auto`` (``_s<seed>`` too) -> ``sparse_rl``."""
    name = split_seed(name)[0]
    head, _, tail = name.rpartition("_")
    return head if head and (tail == "auto" or (tail.startswith("b") and tail[1:].isdigit())) else name


def metric_name(label: str) -> str:
    """A KV setting's label as MLflow accepts it in a metric name (``rkv:32`` -> ``rkv_32``)."""
    return label.replace(":", "_")


def _mean(values: Iterable[float]) -> float:
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


def per_problem(evaluation: Row, label: str) -> list[float]:
    """Per-problem accuracy (correct / samples) of one evaluation entry."""
    row = evaluation["results"][label]
    return [c / row["samples_per_problem"] for c in row["correct_per_problem"]]


def difference_with_stderr(x: list[float], y: list[float]) -> tuple[float, float]:
    """``mean(x - y)`` of paired per-problem accuracies and its standard error (over problems)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"need two paired lists of >= 2 problems, got {len(x)} and {len(y)}")
    diffs = [a - b for a, b in zip(x, y)]
    return sum(diffs) / len(diffs), mean_stderr(diffs)


def held_out(data: Runs) -> list[Row]:
    """Per variant and KV setting of its last evaluation: accuracy before and after with standard
    errors, the ratio to the dense variant's accuracy under the same setting (paired over problems)
    and the drop from the variant's own dense decoding (dense minus this setting)."""
    rows = []
    for name, d in data.items():
        if not d["eval"]:
            continue
        seed = split_seed(name)[1]  # the dense run of the same seed is the denominator
        dense_run = data.get("dense" if seed is None else f"dense_s{seed}", {}).get("eval")
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


def _seed_groups(rows: list[Row], *fields: str) -> dict[tuple[Any, ...], list[Row]]:
    """The rows of seeded runs grouped by (variant without its seed, *the rows' ``fields``)."""
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for row in rows:
        base, seed = split_seed(row["variant"])
        if seed is not None:
            groups.setdefault((base, *(row[f] for f in fields)), []).append(row)
    return groups


def over_seeds(accuracy: list[Row]) -> list[Row]:
    """Per variant (seeds merged) and KV setting: the mean over seeds of the held-out accuracy, of the
    ratio to the same seed's dense variant and of the drop from dense decoding, each with its standard
    error across seeds (the spread of training runs; each seed's own s.e. over problems is in the
    per-run table). Nothing when no run has a seed."""
    out = []
    for (base, setting), rows in _seed_groups(accuracy, "setting").items():
        merged = {"variant": base, "setting": setting, "seeds": len(rows)}
        for key in ("after", "ratio_to_dense", "drop_from_dense"):
            values = [r[key] for r in rows if key in r]
            if values:
                merged[key] = sum(values) / len(values)
                merged[f"{key}_stderr_seeds"] = mean_stderr(values) if len(values) > 1 else float("nan")
        out.append(merged)
    return out


def training_over_seeds(rows: list[Row]) -> list[Row]:
    """Per variant (seeds merged): each training metric of :func:`summarize`'s rows as ``"mean +- s.e."``
    across seeds (a markdown cell). Nothing when no run has a seed."""
    out = []
    for (base,), runs in _seed_groups(rows).items():
        merged: Row = {"variant": base, "seeds": len(runs)}
        for key, value in runs[0].items():
            if key in ("variant", "iterations") or not isinstance(value, float):
                continue
            values = [r[key] for r in runs if r[key] == r[key]]  # (NaN: a metric that run did not log)
            merged[key] = ("nan" if not values else f"{sum(values) / len(values):.3f}" if len(values) == 1
                           else f"{sum(values) / len(values):.3f} +- {mean_stderr(values):.3f}")
        out.append(merged)
    return out


def _table(rows: list[Row]) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row.get(k, float('nan')):.3f}" if isinstance(row.get(k), float)
                                       else str(row.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def summarize(data: Runs) -> tuple[list[Row], list[Row], str]:
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
               "token_rejected_high_mean": _mean(d["curves"]["correction/token_rejected_high_fraction"].values()),
               "veto_mean": _mean(d["curves"]["correction/veto_fraction"].values()),
               "is_weight_max_mean": _mean(d["curves"]["correction/is_weight_max"].values()),
               # the rollouts' KV: the budget (its mean over iterations when automatic) and each sample's
               # peak KV in tokens (prompt included) and as a fraction of its dense KV (1 for dense rollouts)
               "budget_mean": _mean(d["curves"]["kv/budget"].values()),
               "peak_kv_tokens": _mean(d["curves"]["kv/peak_tokens_per_sample"].values()),
               "peak_kv_fraction": _mean(d["curves"]["kv/peak_fraction_of_dense"].values())
               if base_variant(name) != "dense" else 1.0,
               "rollout_tokens_per_s": _mean(d["curves"]["time/rollout_tokens_per_s"].values()),
               "iteration_s": _mean(d["curves"]["time/iteration_s"].values())}
        rows.append(row)
    accuracy = held_out(data)
    table = _table(rows) + ("\n\nHeld-out mean@k after the last iteration, +- s.e. over problems (ratios and "
                           "drops paired over the same problems):\n\n" + _table(accuracy) if accuracy else "")
    seeds = over_seeds(accuracy)
    if seeds:
        table += "\n\nOver seeds (means, s.e. across seeds):\n\n" + _table(seeds)
    training = training_over_seeds(rows)
    if training:
        table += "\n\nTraining metrics over seeds (mean +- s.e. across seeds):\n\n" + _table(training)
    return rows, accuracy, table


def plot_groups(data: Runs) -> dict[str, list[str]]:
    """The figure's lines: when any run has a seed, one per variant with its seeds merged
    (``naive_s1``, ``naive_s2`` -> ``naive``), else one per run."""
    if not any(split_seed(name)[1] is not None for name in data):
        return {name: [name] for name in data}
    groups: dict[str, list[str]] = {}
    for name in data:
        groups.setdefault(split_seed(name)[0], []).append(name)
    return groups


def mean_curve(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """One metric's histories (step -> value) of several runs -> (steps, mean over the runs that logged
    each step, standard error across them: 0 where one did)."""
    steps = sorted({step for curve in curves for step in curve})
    values = [[curve[step] for curve in curves if step in curve] for step in steps]
    return steps, [sum(v) / len(v) for v in values], [mean_stderr(v) for v in values]
