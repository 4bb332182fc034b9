"""The metrics of an iteration's optimizer steps: the figures a step adds to the correction's and the
train step's own (its advantages; mismatch and rejection by staleness), and how the steps' metrics
become the iteration's, by one declared reduction per metric (docs/metrics.md: per-iteration values
average the steps, maxima take the max, minima the min, skipped steps add up); and what a dense
sampler's mismatch may be at most (float rounding alone).
"""
from __future__ import annotations

import math
import re
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.algo.correction import LOG_RHO_QUANTILES, compute_correction


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
_STALENESS = re.compile(r"_(staleness\d+|resumed)$")  # metrics_by_staleness: reduced as the metric it splits


def reduction(key: str) -> str:
    """The declared reduction of step metric ``key`` (``mismatch/k3_staleness1``, ``mismatch/k3_resumed``:
    that of ``mismatch/k3``)."""
    base = _STALENESS.sub("", key)
    if base not in STEP_REDUCTIONS:
        raise KeyError(f"step metric {key!r} has no declared reduction: add it to "
                       f"sparse_rl_mega/train/step_metrics.py STEP_REDUCTIONS")
    return STEP_REDUCTIONS[base]


def merge_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The iteration's metrics from its steps' (in the steps' key order). A metric that only some steps
    report (by staleness: rows of that staleness in some steps only) reduces over those steps."""
    keys = dict.fromkeys(key for metrics in per_step for key in metrics)
    return {key: _REDUCE[reduction(key)]([m[key] for m in per_step if key in m]) for key in keys}


def advantage_metrics(advantages: torch.Tensor, group) -> dict[str, float]:
    """Mean, std, min, max and zero fraction of the advantages of a global batch (reduced over DP)."""
    adv = advantages.double()
    sums = torch.stack([adv.sum(), adv.pow(2).sum(), adv.new_tensor(float(adv.numel())),
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
    """The mismatch and rejection figures of the tokens trained at ``iteration`` with each staleness
    0..``max_staleness`` (learner version - the version that sampled the token) present in the global
    batch (``part``: this DP rank's rows of it), e.g. ``mismatch/k3_staleness1``; with partial rollouts
    also of the tokens sampled after their sample was paused for a push (``mismatch/k3_resumed``: under
    newer weights than the sample's first token, on the KV that ``rollout.partial`` chose to keep)."""
    versions = part.token_versions.long() if part.token_versions is not None else \
        part.weight_versions[:, None].expand_as(part.response_mask)
    staleness = iteration - versions
    resumed = versions > part.weight_versions[:, None]
    groups = {f"_staleness{s}": staleness == s for s in range(max_staleness + 1)}
    groups["_resumed"] = resumed
    keys = ("mismatch/k3", "correction/token_rejected_fraction", "correction/veto_fraction")
    out: dict[str, float] = {}
    for suffix, selected in groups.items():
        mask = part.response_mask * selected
        rows = (mask.sum(dim=1) > 0).nonzero().flatten()
        present = mask.new_tensor([float(rows.numel())])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(present, group=group)
        if not present.item():
            continue
        _, _, m = compute_correction(part.logp_old[rows], part.logp_sparse[rows], mask[rows], correction, group=group)
        out.update({f"{key}{suffix}": m[key] for key in (keys if suffix != "_resumed" else keys[:2])})
    return out


# The largest per-token |logp_engine - logp_learner| that the two implementations' rounding explains
# for the same weights at temperature 1, by the model's dtype: float32, the engine-vs-learner sync bound
# (docs/testing.md, 10x the spread measured across CPU kernels); bfloat16 / float16, 10x the ~2e-3 that
# SGLang and transformers differ by in bf16 (shared notes, sglang-on-cpu.md).
LOGPROB_AGREEMENT = {"float64": 1e-4, "float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


def dense_k3_bound(dtype: str, temperature: float) -> float:
    """The most ``mismatch/k3`` (a mean of ``rho - 1 - log rho``) that rounding explains when a dense
    sampler and the learner's old policy hold the same weights: every token's ``|log rho|`` at most
    the dtype's agreement divided by the temperature (logits are divided by it before the softmax), and
    ``k3`` largest at ``log rho = +tau``."""
    tau = LOGPROB_AGREEMENT[dtype] / temperature
    return math.expm1(tau) - tau


def dense_sampler_k3(metrics: dict[str, float], max_staleness: int) -> Optional[float]:
    """``mismatch/dense_sampler_k3`` of an iteration of dense rollouts: the mismatch of the rows sampled
    with the learner's current weights (all of them with ``max_staleness`` 0; those of staleness 0
    otherwise), which only rounding may cause; None when there are none."""
    return metrics.get("mismatch/k3_staleness0" if max_staleness else "mismatch/k3")


def dense_mismatch_warning(iteration: int, metrics: dict[str, float], dtype: str, rollout) -> Optional[str]:
    """The console's warning when an iteration's ``mismatch/dense_sampler_k3`` exceeds what rounding
    explains (:func:`dense_k3_bound`): the learner's old policy is then not the distribution the engines
    sampled from, and the correction rejects and reweights tokens for a mismatch that does not exist.
    None otherwise (and for an iteration without the metric: compressed rollouts)."""
    k3 = metrics.get("mismatch/dense_sampler_k3")
    bound = dense_k3_bound(dtype, rollout.temperature)
    if k3 is None or k3 <= bound:
        return None
    return (f"[warn] iteration {iteration + 1}: dense rollouts differ from the learner's old policy by k3 {k3:.2e}, "
            f"more than {dtype} rounding explains ({bound:.1e} at temperature {rollout.temperature:g}): the learner "
            f"does not recompute the distribution the engines sample from (temperature {rollout.temperature:g}, "
            f"top_p {rollout.top_p:g}, top_k {rollout.top_k}) or holds other weights")
