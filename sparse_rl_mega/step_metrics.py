"""The metrics of an iteration's optimizer steps: the figures a step adds to the correction's and the
train step's own (its advantages; mismatch and rejection by staleness), and how the steps' metrics
become the iteration's, by one declared reduction per metric (docs/metrics.md: per-iteration values
average the steps, maxima take the max, minima the min, skipped steps add up).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from sparse_rl_mega.algo.correction import LOG_RHO_QUANTILES

MEAN, SUM, MAX, MIN = "mean", "sum", "max", "min"
_REDUCE = {MEAN: lambda values: sum(values) / len(values), SUM: sum, MAX: max, MIN: min}

# every metric an optimizer step reports -> how the iteration's steps combine
STEP_REDUCTIONS: dict[str, str] = {
    # algo/correction.py compute_correction: fractions and means over the step's tokens; its largest weight
    "correction/veto_fraction": MEAN, "correction/seq_rejected_fraction": MEAN,
    "correction/token_rejected_fraction": MEAN, "correction/token_rejected_low_fraction": MEAN,
    "correction/token_rejected_high_fraction": MEAN, "correction/kept_token_fraction": MEAN,
    "correction/is_weight_mean": MEAN, "correction/is_weight_max": MAX, "correction/is_ess_fraction": MEAN,
    "mismatch/k1": MEAN, "mismatch/k2": MEAN, "mismatch/k3": MEAN,
    **{f"mismatch/log_rho_p{q:g}": MEAN for q in LOG_RHO_QUANTILES},
    # advantage_metrics
    "advantage/mean": MEAN, "advantage/std": MEAN, "advantage/max": MAX, "advantage/min": MIN,
    "advantage/zero_fraction": MEAN,
    # learner/step.py train_step
    "train/loss": MEAN, "train/loss_denominator": MEAN, "train/clip_fraction": MEAN, "train/approx_kl_old": MEAN,
    "train/entropy": MEAN, "train/kept_tokens": MEAN, "train/grad_norm": MEAN, "train/update_ok": MEAN,
    "train/skipped_steps": SUM, "train/kl_ref": MEAN,
}
_STALENESS = re.compile(r"_staleness\d+$")  # metrics_by_staleness: reduced as the metric it splits


def reduction(key: str) -> str:
    """The declared reduction of step metric ``key`` (``mismatch/k3_staleness1``: that of ``mismatch/k3``)."""
    base = _STALENESS.sub("", key)
    if base not in STEP_REDUCTIONS:
        raise KeyError(f"step metric {key!r} has no declared reduction: add it to "
                       f"sparse_rl_mega/step_metrics.py STEP_REDUCTIONS")
    return STEP_REDUCTIONS[base]


def merge_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The iteration's metrics from its steps' (in the steps' key order). A metric that only some steps
    report (by staleness: rows of that staleness in some steps only) reduces over those steps."""
    keys = dict.fromkeys(key for metrics in per_step for key in metrics)
    return {key: _REDUCE[reduction(key)]([m[key] for m in per_step if key in m]) for key in keys}


def advantage_metrics(advantages: torch.Tensor, group) -> dict[str, float]:
    """Mean, std, min, max and zero fraction of the advantages of a global batch (reduced over DP)."""
    adv = advantages.double()
    sums = torch.stack([adv.sum(), adv.pow(2).sum(), torch.tensor(float(adv.numel()), dtype=torch.float64),
                        (adv == 0).double().sum()])
    extremes = torch.stack([adv.max(), -adv.min()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    total, squares, count, zeros = sums.tolist()
    mean = total / count
    return {"advantage/mean": mean, "advantage/std": max(squares / count - mean * mean, 0.0) ** 0.5,
            "advantage/max": float(extremes[0]), "advantage/min": -float(extremes[1]),
            "advantage/zero_fraction": zeros / count}


def metrics_by_staleness(part, iteration: int, max_staleness: int, correction, group) -> dict[str, float]:
    """The mismatch and rejection figures of the rows trained at ``iteration`` with each staleness
    0..``max_staleness`` (learner version - the version that sampled the row) present in the global
    batch (``part``: this DP rank's rows of it), e.g. ``mismatch/k3_staleness1``."""
    from sparse_rl_mega.algo.correction import compute_correction

    staleness = iteration - part.weight_versions
    out: dict[str, float] = {}
    for s in range(max_staleness + 1):
        rows = (staleness == s).nonzero().flatten()
        present = torch.tensor([float(rows.numel())])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(present, group=group)
        if not present.item():
            continue
        _, _, m = compute_correction(part.logp_old[rows], part.logp_sparse[rows], part.response_mask[rows],
                                     correction, group=group)
        out.update({f"{key}_staleness{s}": m[key] for key in ("mismatch/k3", "correction/token_rejected_fraction",
                                                               "correction/veto_fraction")})
    return out
