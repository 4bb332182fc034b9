"""Sparsity-aware rejection sampling and importance reweighting (Sparse-RL and its peers).

The sampler ``pi_sparse`` decoded with a compressed KV cache; the dense old policy ``pi_old`` is
recomputed by the learner. Per response token, in log space with a safety bound ``b``:

    log rho_t = clamp(logp_old_t - logp_sparse_t, -b, b)

* IS weights at a level: token ``log w_t = log rho_t``; sequence ``log w_i = sum_t log rho_t``;
  geometric ``log w_i = mean_t log rho_t`` (sequence weights are broadcast to their tokens). Modes:
  truncate ``min(w, U)``, clip ``clamp(w, L, U)``, mask ``w * 1[L <= w <= U]``. Batch normalisation
  divides by the mean weight over every original response token (token level) or every sequence
  (sequence/geometric level) of the global batch: all data-parallel ranks via ``group``.
* Rejection (the token leaves numerator and denominator of the loss): sequence veto if any
  ``rho_t < C``; bounds ``[L, U]`` on ``rho`` at token / sequence / geometric level; a bound on a
  divergence estimate between pi_sparse and pi_old (``k1 = -log rho``, ``k2 = (log rho)^2 / 2``,
  ``k3 = rho - 1 - log rho``) per token or aggregated per sequence (sum, mean, max of ``|k|``).

Presets (``sparse_rl``, ``tis``, ``icepop``, ``naive``, ``bypass``) are defined in
:data:`sparse_rl_mega.config.CORRECTION_PRESETS`; see ``docs/algorithm.md``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from sparse_rl_mega.config import LOG_RHO_QUANTILES, CorrectionConfig


def _reduce(values: list[torch.Tensor], group: Any, op: Any = None) -> list[torch.Tensor]:
    """Reduce scalars over ``group`` (None: local only) in one collective, in float64."""
    packed = torch.stack([v.to(torch.float64).reshape(()) for v in values])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, op=op or dist.ReduceOp.SUM, group=group)
    return list(packed.unbind())


def _outside(log_value: torch.Tensor, low: Optional[float], high: Optional[float]) -> torch.Tensor:
    """``exp(log_value)`` outside ``[low, high]`` (a missing bound is open), compared in log space."""
    out = torch.zeros_like(log_value, dtype=torch.bool)
    if low is not None:
        out |= log_value < (math.log(low) if low > 0 else -math.inf)
    if high is not None:
        out |= log_value > math.log(high)
    return out


def divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_sparse || pi_old) from ``log rho = logp_old - logp_sparse``."""
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.pow(2)
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown divergence estimator {estimator!r}")


def resolve(cfg: Union[str, CorrectionConfig]) -> CorrectionConfig:
    return CorrectionConfig.from_preset(cfg) if isinstance(cfg, str) else cfg


def compute_correction(logp_old: torch.Tensor, logp_sparse: torch.Tensor, response_mask: torch.Tensor,
                       cfg: Union[str, CorrectionConfig], group: Optional[dist.ProcessGroup] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """IS weights, loss mask and metrics for one global batch (this rank's rows of it).

    Args:
        logp_old: ``[batch, tokens]`` dense old-policy logprobs of the sampled tokens.
        logp_sparse: ``[batch, tokens]`` sampler logprobs recorded by the engine.
        response_mask: ``[batch, tokens]`` 1 on response tokens, 0 on prompt and padding.
        cfg: a preset name (``"sparse_rl"``, ...) or a :class:`CorrectionConfig`.
        group: the data-parallel group holding the other rows of the global batch (None: local only).
    Returns:
        ``is_weights [batch, tokens]`` (detached, 0 off-response), ``loss_mask [batch, tokens]``
        (response mask minus rejections) and metrics whose values are global over ``group``.
    """
    cfg = resolve(cfg)
    dtype = torch.promote_types(logp_old.dtype, torch.float32)  # float32, or float64 inputs stay float64
    mask = response_mask.to(dtype)
    valid = mask > 0
    zeros = torch.zeros_like(mask)
    tokens_per_seq = mask.sum(dim=1)
    has_tokens = tokens_per_seq > 0
    raw_log_ratio = torch.where(valid, logp_old.to(dtype) - logp_sparse.to(dtype), zeros)
    log_ratio = raw_log_ratio.clamp(-cfg.log_ratio_bound, cfg.log_ratio_bound)
    seq_log_ratio = {"sequence": log_ratio.sum(dim=1),
                     "geometric": log_ratio.sum(dim=1) / tokens_per_seq.clamp(min=1)}

    # ---- rejection
    vetoed = torch.zeros_like(has_tokens)
    if cfg.seq_veto_threshold is not None:
        vetoed = (valid & (raw_log_ratio < math.log(cfg.seq_veto_threshold))).any(dim=1)
    token_rejected = torch.zeros_like(valid)
    seq_rejected = torch.zeros_like(has_tokens)
    if cfg.reject_level == "token":
        token_rejected |= _outside(log_ratio, cfg.reject_low, cfg.reject_high) & valid
    elif cfg.reject_level in seq_log_ratio:
        seq_rejected |= _outside(seq_log_ratio[cfg.reject_level], cfg.reject_low, cfg.reject_high) & has_tokens
    if cfg.kl_reject_threshold is not None:
        div = divergence(log_ratio, cfg.kl_reject_estimator) * mask
        if cfg.kl_reject_agg == "token":
            token_rejected |= (div.abs() > cfg.kl_reject_threshold) & valid
        else:
            aggregate = {"seq_sum": div.sum(dim=1).abs(),
                         "seq_mean": div.sum(dim=1).abs() / tokens_per_seq.clamp(min=1),
                         "seq_max": div.abs().amax(dim=1)}[cfg.kl_reject_agg]
            seq_rejected |= (aggregate > cfg.kl_reject_threshold) & has_tokens
    seq_dropped = vetoed | seq_rejected
    loss_mask = mask * (~token_rejected).to(dtype) * (~seq_dropped).to(dtype).unsqueeze(1)

    # ---- importance weights
    if cfg.is_level == "none":
        is_weights = mask.clone()
    else:
        if cfg.is_level == "token":
            log_w = log_ratio
        else:
            log_w = seq_log_ratio[cfg.is_level].clamp(-cfg.log_ratio_bound, cfg.log_ratio_bound)
            log_w = log_w.unsqueeze(1).expand_as(mask)
        w = torch.exp(log_w)
        if cfg.is_mode == "truncate":
            w = w.clamp(max=cfg.is_high)
        elif cfg.is_mode == "clip":
            w = w.clamp(min=cfg.is_low, max=cfg.is_high)
        else:  # mask: weights outside [L, U] are zeroed; the tokens stay in the denominator
            w = w * (~_outside(log_w, cfg.is_low, cfg.is_high)).to(dtype)
        w = w * mask
        if cfg.is_batch_normalize:
            if cfg.is_level == "token":
                total, count = _reduce([w.sum(), mask.sum()], group)
            else:  # one weight per sequence (constant over its response tokens)
                seq_weight = w.amax(dim=1) * has_tokens
                total, count = _reduce([seq_weight.sum(), has_tokens.sum()], group)
            mean_weight = (total / count.clamp(min=1)).to(dtype).clamp(min=1e-8)
            w = w / mean_weight
        is_weights = w.detach()

    # ---- metrics (sums over the group first, then ratios)
    k1, k2, k3 = (divergence(log_ratio, e) * mask for e in ("k1", "k2", "k3"))
    # which side a rejected token fell on: rho < 1, a token the compressed sampler preferred; rho > 1,
    # one the dense policy preferred
    rejected_low = token_rejected & (log_ratio < 0)
    sums = _reduce([mask.sum(), has_tokens.sum(), (vetoed & has_tokens).sum(), (seq_dropped & has_tokens).sum(),
                    token_rejected.sum(), rejected_low.sum(), loss_mask.sum(), k1.sum(), k2.sum(), k3.sum(),
                    is_weights.sum(), (is_weights.pow(2)).sum()], group)
    n_tok, n_seq, n_veto, n_drop, n_rej, n_rej_low, kept, k1_sum, k2_sum, k3_sum, w_sum, w2_sum = sums
    w_max, = _reduce([is_weights.max() if is_weights.numel() else is_weights.new_zeros(())], group, dist.ReduceOp.MAX)
    n_tok_c, n_seq_c = n_tok.clamp(min=1), n_seq.clamp(min=1)
    metrics = {
        "correction/veto_fraction": float(n_veto / n_seq_c),
        "correction/seq_rejected_fraction": float(n_drop / n_seq_c),
        "correction/token_rejected_fraction": float(n_rej / n_tok_c),
        "correction/token_rejected_low_fraction": float(n_rej_low / n_tok_c),
        "correction/token_rejected_high_fraction": float((n_rej - n_rej_low) / n_tok_c),
        "correction/kept_token_fraction": float(kept / n_tok_c),
        "correction/is_weight_mean": float(w_sum / n_tok_c),
        "correction/is_weight_max": float(w_max),
        # Kish effective sample size of the token weights, as a fraction of the tokens
        "correction/is_ess_fraction": float(w_sum.pow(2) / (w2_sum.clamp(min=1e-12) * n_tok_c)),
        "mismatch/k1": float(k1_sum / n_tok_c),
        "mismatch/k2": float(k2_sum / n_tok_c),
        "mismatch/k3": float(k3_sum / n_tok_c),
    }
    quantiles = log_ratio_quantiles(log_ratio[valid], LOG_RHO_QUANTILES, cfg.log_ratio_bound, group)
    metrics.update({f"mismatch/log_rho_p{q:g}": value for q, value in zip(LOG_RHO_QUANTILES, quantiles)})
    return is_weights, loss_mask, metrics


LOG_RHO_BIN = 1e-3  # resolution of the quantiles of log rho (coarser where the bound needs > 2^16 bins)


def log_ratio_quantiles(log_ratio: torch.Tensor, percents: Sequence[float], bound: float,
                        group: Any = None) -> list[float]:
    """Quantiles (``percents``) of ``log_ratio`` (response tokens' ``log rho``, in ``[-bound, bound]``)
    over every rank of ``group``: from a histogram with bins of ``LOG_RHO_BIN`` summed over the group
    (one all-reduce of a fixed size, however many tokens): the lower edge of the bin holding numpy's
    ``lower`` quantile, so at most one bin below it. NaN when there are no tokens."""
    bins = min(int(math.ceil(2 * bound / LOG_RHO_BIN)), 1 << 16)
    width = max(LOG_RHO_BIN, 2 * bound / bins)
    index = ((log_ratio.detach().to(torch.float64) + bound) / width).floor().clamp(0, bins - 1).long()
    counts = torch.bincount(index, minlength=bins).to(torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    total = int(counts.sum())
    if total == 0:
        return [float("nan")] * len(percents)
    cumulative = counts.cumsum(0)
    out = []
    for q in percents:
        rank = math.floor(q / 100 * (total - 1))  # 0-based position of the lower sample
        b = int(torch.searchsorted(cumulative, cumulative.new_tensor(rank + 1)))
        out.append(round(b * width - bound, 9))
    return out
