"""An ablation's figures: the training curves and held-out accuracy per variant (``ablation.png``) and the
budget map (``budget_map.png``). matplotlib is imported when drawing."""
from __future__ import annotations

from pathlib import Path

from sparse_rl_mega.studies.statistics import base_variant, mean_curve, plot_groups, split_seed
from sparse_rl_mega.train.evaluation import mean_stderr

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
PANELS.append(("KV budget (the automatic budget's, or the fixed one)", [("kv/budget", "")]))
CURVES = [key for _, lines in PANELS for key, _ in lines] + ["kv/peak_fraction_of_dense", "kv/peak_tokens_per_sample",
                                                             "correction/veto_fraction", "time/rollout_tokens_per_s",
                                                             "time/iteration_s"]

def plot(data: dict[str, dict], path: Path) -> None:
    """The training curves and the held-out accuracy, a colour per line of :func:`plot_groups`: seeded
    variants as their mean over seeds with a band of +- 1 s.e. across seeds (held-out: error bars across
    seeds), unseeded runs as they are (held-out: +- 1 s.e. over problems); one legend for the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    groups = plot_groups(data)
    seeded = any(split_seed(name)[1] is not None for name in data)
    has_eval = any(d["eval"] for d in data.values())
    panels = len(PANELS) + int(has_eval)
    columns = min(panels, 3)
    rows = -(-panels // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(4.4 * columns, 3.3 * rows + 0.6), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.set_visible(False)
    axes = axes[:panels]
    styles = ["-", "--", ":"]
    for ax, (title, lines) in zip(axes, PANELS):
        for k, names in enumerate(groups.values()):
            for (key, _), style in zip(lines, styles):
                steps, mean, stderr = mean_curve([data[name]["curves"][key] for name in names])
                if not steps:  # (runs logged before the metric existed)
                    continue
                x = [s + 1 for s in steps]
                ax.plot(x, mean, marker="o", markersize=3, linestyle=style, color=f"C{k}")
                if len(names) > 1:
                    ax.fill_between(x, [m - e for m, e in zip(mean, stderr)], [m + e for m, e in zip(mean, stderr)],
                                    color=f"C{k}", alpha=0.15, linewidth=0)
        styled = ", ".join(f"{suffix.strip() or 'all'} {style}" for (_, suffix), style in zip(lines, styles)
                           ) if len(lines) > 1 else ""
        ax.set_title(title + (f"\n(lines: {styled})" if styled else ""), fontsize=9)
        ax.set_xlabel("iteration")
    if has_eval:
        ax, evaluated = axes[-1], set()
        for k, names in enumerate(groups.values()):
            labels = list(dict.fromkeys(label for name in names for h in data[name]["eval"] for label in h["results"]))
            for label in labels:
                by_iteration: dict[int, list[dict]] = {}
                for name in names:
                    for h in data[name]["eval"]:
                        if label in h["results"]:
                            by_iteration.setdefault(h["iteration"], []).append(h["results"][label])
                iterations = sorted(by_iteration)
                evaluated.update(iterations)
                means = [sum(r["mean_at_k"] for r in by_iteration[i]) / len(by_iteration[i]) for i in iterations]
                errors = [mean_stderr([r["mean_at_k"] for r in by_iteration[i]]) if len(names) > 1
                          else by_iteration[i][0].get("mean_at_k_stderr", 0.0) for i in iterations]
                ax.errorbar([i + 0.08 * (k - len(groups) / 2) for i in iterations], means, yerr=errors,
                            marker="o" if label == "dense" else "s", markersize=4, capsize=2,
                            linestyle="-" if label == "dense" else "--", color=f"C{k}")
        several = [len(names) > 1 for names in groups.values()]
        spread = ("across seeds" if all(several) else "across seeds (one run: over problems)" if any(several)
                  else "over problems")
        ax.set_title(f"held-out accuracy, mean@k +- 1 s.e. {spread}\n(o - dense decoding, s -- the rollouts' KV)",
                     fontsize=9)
        ax.set_xlabel("iterations trained")
        if evaluated:
            ax.set_xticks(sorted(evaluated))
            ax.set_xlim(min(evaluated) - 0.5, max(evaluated) + 0.5)
        ax.set_ylim(bottom=0)
    handles = [Line2D([], [], color=f"C{k}", marker="o",
                      label=f"{label} ({len(names)} seed{'s' if len(names) > 1 else ''})" if seeded else label)
               for k, (label, names) in enumerate(groups.items())]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / (3.3 * rows + 0.6), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_budget_map(rows: list[dict], accuracy: list[dict], path: Path) -> bool:
    """The budget map: held-out accuracy against the rollouts' peak KV / dense, a curve per variant
    through its budgets and the automatic runs as points; left under dense decoding as a fraction of the
    dense variant's (paired s.e.), right under the run's own compression. False without the figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    after = {(r["variant"], r["setting"]): r for r in accuracy}
    points: dict[str, list] = {}
    for row in rows:
        name = row["variant"]
        dense = after.get((name, "dense"))
        own = [r for (v, setting), r in after.items() if v == name and setting != "dense"]
        if name == "dense" or dense is None or "ratio_to_dense" not in dense or row["peak_kv_fraction"] != row["peak_kv_fraction"]:
            continue
        points.setdefault(base_variant(name), []).append((row["peak_kv_fraction"], dense, own[0] if own else None,
                                                          name.endswith("_auto"), row["budget_mean"]))
    if not points:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for k, (variant, entries) in enumerate(sorted(points.items())):
        for auto in (False, True):
            chosen = sorted(e for e in entries if e[3] == auto)
            if not chosen:
                continue
            style = dict(marker="*", markersize=12, linestyle="none") if auto else dict(marker="o", linestyle="-")
            label = f"{variant} ({'automatic budget' if auto else 'fixed budgets'})"
            left.errorbar([e[0] for e in chosen], [e[1]["ratio_to_dense"] for e in chosen],
                          yerr=[e[1]["ratio_stderr"] for e in chosen], color=f"C{k}", capsize=2, label=label, **style)
            own = [e for e in chosen if e[2] is not None]
            right.errorbar([e[0] for e in own], [e[2]["after"] for e in own], yerr=[e[2]["after_stderr"] for e in own],
                           color=f"C{k}", capsize=2, label=label, **style)
            for e in chosen:
                left.annotate(f"{e[4]:.0f}", (e[0], e[1]["ratio_to_dense"]), fontsize=7, xytext=(3, 3),
                              textcoords="offset points")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_title("held-out accuracy, dense decoding / dense-trained's (+- paired s.e.)", fontsize=9)
    right.set_title("held-out accuracy under the run's own compression (+- s.e.)", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("rollouts' mean peak KV per sample / dense (labels: mean budget)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
