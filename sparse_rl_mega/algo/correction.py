"""Sparsity-aware rejection sampling and importance reweighting (Sparse-RL, method.md).

The sampler ``pi_sparse`` decoded with a compressed KV cache; the dense old policy ``pi_old`` is
recomputed by the learner. Per response token ``rho_t = exp(clamp(logp_old_t - logp_sparse_t))``:

* sequence veto: a sequence is dropped if ``min_t rho_t < seq_veto_threshold``;
* token rejection: tokens with ``rho_t`` outside ``[token_reject_low, token_reject_high]`` are masked;
* IS weights: ``w_t = min(rho_t, is_truncate)``, batch-normalised to mean 1 over all original
  response tokens of the global batch (every data-parallel rank, every micro-batch).

Rejected tokens leave both the numerator and the denominator of the loss (``loss_mask`` is 0).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.config import CorrectionConfig


def _global_sum(values: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Sum scalars over ``group`` (None: local only) in one collective."""
    packed = torch.stack([v.to(torch.float64) for v in values])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
    return list(packed.unbind())


def _global_max(value: torch.Tensor, group) -> torch.Tensor:
    value = value.to(torch.float64).clone()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def compute_correction(logp_old: torch.Tensor, logp_sparse: torch.Tensor, response_mask: torch.Tensor,
                       cfg: CorrectionConfig, group: Optional[dist.ProcessGroup] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rejection mask and IS weights for one batch.

    Args:
        logp_old: ``[batch, tokens]`` dense old-policy logprobs of the sampled tokens.
        logp_sparse: ``[batch, tokens]`` sampler logprobs recorded by the engine.
        response_mask: ``[batch, tokens]`` 1 for response tokens, 0 for padding.
        cfg: correction settings.
        group: data-parallel group over which batch normalisation and metrics are reduced.
    Returns:
        ``is_weights`` ``[batch, tokens]`` (detached, 0 outside the response), ``loss_mask``
        ``[batch, tokens]`` (response mask with rejections applied) and metrics (global values).
    """
    mask = response_mask.to(torch.float32)
    valid = mask > 0
    log_ratio = (logp_old.float() - logp_sparse.float()).clamp(-cfg.log_ratio_bound, cfg.log_ratio_bound)
    log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    rho = torch.exp(log_ratio)

    if not cfg.enabled:
        is_weights, loss_mask = mask.clone(), mask.clone()
        vetoed = torch.zeros(mask.shape[0], dtype=torch.bool)
        token_rejected = torch.zeros_like(valid)
    else:
        if cfg.seq_veto_threshold is not None:
            min_rho = torch.where(valid, rho, torch.full_like(rho, float("inf"))).amin(dim=1)
            vetoed = min_rho < cfg.seq_veto_threshold
        else:
            vetoed = torch.zeros(mask.shape[0], dtype=torch.bool)
        token_rejected = torch.zeros_like(valid)
        if cfg.token_reject_low is not None:
            token_rejected |= rho < cfg.token_reject_low
        if cfg.token_reject_high is not None:
            token_rejected |= rho > cfg.token_reject_high
        token_rejected &= valid
        loss_mask = mask * (~token_rejected).float() * (~vetoed).float().unsqueeze(1)

        weights = rho if cfg.is_truncate is None else rho.clamp(max=cfg.is_truncate)
        weights = weights * mask
        if cfg.is_batch_normalize:
            # Mean over all original response tokens of the global batch.
            weight_sum, token_count = _global_sum([weights.sum(), mask.sum()], group)
            mean_weight = (weight_sum / token_count.clamp(min=1)).to(torch.float32)
            weights = weights / mean_weight.clamp(min=1e-8)
        is_weights = weights.detach()

    # ---- metrics, reduced over the group (sums first, then ratios)
    seq_has_tokens = (mask.sum(dim=1) > 0).float()
    k3 = (rho - 1.0) - log_ratio  # KL(pi_sparse || pi_old) estimator per token, >= 0
    w_masked = is_weights * loss_mask
    sums = _global_sum([
        mask.sum(), seq_has_tokens.sum(), (vetoed.float() * seq_has_tokens).sum(),
        (token_rejected.float()).sum(), (-log_ratio * mask).sum(), (k3 * mask).sum(),
        (is_weights * mask).sum(), (is_weights.pow(2) * mask).sum(), loss_mask.sum(), w_masked.sum(),
    ], group)
    (n_tok, n_seq, n_veto, n_rej, k1_sum, k3_sum, w_sum, w2_sum, kept, _) = sums
    n_tok_c = n_tok.clamp(min=1)
    metrics = {
        "correction/veto_fraction": float(n_veto / n_seq.clamp(min=1)),
        "correction/token_rejected_fraction": float(n_rej / n_tok_c),
        "correction/kept_token_fraction": float(kept / n_tok_c),
        "correction/is_weight_mean": float(w_sum / n_tok_c),
        "correction/is_weight_max": float(_global_max((is_weights * mask).max() if mask.numel() else
                                                      torch.tensor(0.0), group)),
        # Kish effective sample size of the weights, as a fraction of the token count.
        "correction/is_ess_fraction": float(w_sum.pow(2) / (w2_sum.clamp(min=1e-12) * n_tok_c)),
        "mismatch/k1": float(k1_sum / n_tok_c),
        "mismatch/k3": float(k3_sum / n_tok_c),
    }
    return is_weights, loss_mask, metrics
