"""PPO-clip policy loss with sparsity-corrected weights and masks.

The loss of one micro-batch is returned as ``(loss_sum, normaliser_count)``; the trainer divides by
the normaliser summed over the whole step (all micro-batches, all data-parallel ranks), so the
gradient does not depend on how the batch is split.
"""
from __future__ import annotations

import torch


def ppo_token_loss(logp_theta: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                   eps_clip_low: float, eps_clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate ``max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)``.

    Args:
        logp_theta, logp_old: ``[batch, tokens]``; advantages: ``[batch, 1]`` or ``[batch, tokens]``.
    Returns:
        ``pg_loss [batch, tokens]`` and ``clipped [batch, tokens]`` (bool: the clipped branch was taken).
    """
    ratio = torch.exp((logp_theta - logp_old).clamp(-20.0, 20.0))
    unclipped = -ratio * advantages
    clipped_loss = -ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high) * advantages
    pg_loss = torch.maximum(unclipped, clipped_loss)
    return pg_loss, clipped_loss > unclipped


def aggregate(token_loss: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum part and count part of the step loss for this micro-batch.

    ``seq-mean-token-mean``: sum over sequences of the per-sequence token mean; count = sequences with
    at least one kept token. ``token-mean``: sum over kept tokens; count = kept tokens.
    """
    if mode == "token-mean":
        return (token_loss * loss_mask).sum(), loss_mask.sum()
    if mode == "seq-mean-token-mean":
        tokens_per_seq = loss_mask.sum(dim=1)
        has_tokens = tokens_per_seq > 0
        seq_means = (token_loss * loss_mask).sum(dim=1) / tokens_per_seq.clamp(min=1)
        return (seq_means * has_tokens).sum(), has_tokens.sum().to(token_loss.dtype)
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def policy_loss(logp_theta: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                is_weights: torch.Tensor, loss_mask: torch.Tensor, *, eps_clip_low: float,
                eps_clip_high: float, agg_mode: str, logp_ref: torch.Tensor | None = None,
                kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Corrected PPO loss of one micro-batch.

    Args:
        logp_theta: ``[batch, tokens]`` current learner logprobs (requires grad).
        logp_old: ``[batch, tokens]`` dense old-policy logprobs.
        advantages: ``[batch]`` sequence advantages.
        is_weights, loss_mask: ``[batch, tokens]`` from :func:`compute_correction`.
        logp_ref: optional reference-policy logprobs for a k3 KL penalty with ``kl_coef``.
    Returns:
        ``(loss_sum, count, stats)``: the step loss is ``sum(loss_sum) / sum(count)`` over the step;
        ``stats`` holds detached sums (clipped tokens, kept tokens, approx KL to old) for metrics.
    """
    pg_loss, clipped = ppo_token_loss(logp_theta, logp_old, advantages.unsqueeze(1), eps_clip_low, eps_clip_high)
    token_loss = pg_loss * is_weights
    if logp_ref is not None and kl_coef > 0:
        log_ratio_ref = (logp_ref - logp_theta).clamp(-20.0, 20.0)
        token_loss = token_loss + kl_coef * (torch.exp(log_ratio_ref) - 1.0 - log_ratio_ref)
    loss_sum, count = aggregate(token_loss, loss_mask, agg_mode)
    with torch.no_grad():
        stats = {
            "clipped_tokens": (clipped.float() * loss_mask).sum(),
            "kept_tokens": loss_mask.sum(),
            "approx_kl_old_sum": (0.5 * (logp_theta - logp_old).pow(2) * loss_mask).sum(),
        }
    return loss_sum, count, stats
