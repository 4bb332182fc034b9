"""PPO-clip policy loss with the correction's IS weights and loss mask.

Per token, with ``r_t = exp(logp_theta_t - logp_old_t)`` and the sequence advantage ``A``:

    pg_t   = max(-r_t A, -clip(r_t, 1 - eps_low, 1 + eps_high) A)       (for A < 0 and dual clip c:
                                                                          pg_t = min(pg_t, -c A))
    loss_t = w_t pg_t + kl_coef KL_t(pi_theta || pi_ref) - entropy_coef H_t

A micro-batch returns ``(loss_sum, count)``; the step loss is ``sum(loss_sum) / sum(count)`` over all
micro-batches and data-parallel ranks of the step, so the gradient does not depend on the split.
``loss_sum`` (kept tokens are those the correction left in ``loss_mask``):

* ``seq-mean-token-mean``: each sequence's mean over its kept tokens (0 without any), summed;
* ``seq-mean-token-sum``: each sequence's sum over its kept tokens, summed;
* ``token-mean`` (DAPO): the sum over kept tokens.

``count`` (``denominator``):

* ``batch`` (the paper's release, slime's ``get_sum_of_sample_mean`` and its ``/ global_batch_size``):
  every sequence of the step, vetoed and fully rejected ones included; for ``token-mean`` every
  response token before the correction, at least one per sequence (slime's ``num_tokens``).
  A step that rejects more moves the weights less.
* ``kept``: only the sequences (``token-mean``: tokens) that kept a token. The surviving sequences
  carry the whole step whatever was rejected.
"""
from __future__ import annotations

from typing import Optional

import torch

from sparse_rl_mega.algo.correction import divergence
from sparse_rl_mega.config import AlgorithmConfig


def ppo_token_loss(logp_theta: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                   eps_clip_low: float, eps_clip_high: float, dual_clip: Optional[float] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate ``[batch, tokens]`` and where clipping was active (bool).

    ``advantages`` is ``[batch, 1]`` or ``[batch, tokens]``."""
    ratio = torch.exp((logp_theta - logp_old).clamp(-20.0, 20.0))
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high) * advantages
    pg_loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -dual_clip * advantages
        capped = (advantages < 0) & (pg_loss > cap)
        pg_loss = torch.where(capped, cap.expand_as(pg_loss), pg_loss)
        was_clipped = was_clipped | capped
    return pg_loss, was_clipped


def kl_penalty(logp_theta: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on samples: k1, k2 or k3 (low variance, >= 0); the
    same estimators as the correction's, with ``log rho = log pi_ref - log pi_theta``. ``low_var_kl``:
    k3 capped at 10 (slime's name; a token past the cap gives no KL gradient)."""
    log_rho = (logp_ref - logp_theta).clamp(-20.0, 20.0)
    if estimator == "low_var_kl":
        return divergence(log_rho, "k3").clamp(max=10.0)
    return divergence(log_rho, estimator)


def aggregate(token_loss: torch.Tensor, loss_mask: torch.Tensor, mode: str, denominator: str = "batch",
              response_tokens: Optional[torch.Tensor] = None, seq_tokens: Optional[torch.Tensor] = None,
              count_sequences: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum part, count part)`` of this micro-batch's share of the step loss (see module doc).

    ``response_tokens`` ``[batch]``: each sequence's response tokens before the correction (needed by
    ``token-mean`` with the ``batch`` denominator). With context parallelism a rank sees only part of
    each sequence's tokens: ``seq_tokens`` ``[batch]`` gives each whole sequence's kept-token count
    (the per-sequence mean's denominator), and only one rank of the context-parallel group counts
    whole sequences (``count_sequences``), so that summing the parts over the group gives the unsplit
    result."""
    if denominator not in ("batch", "kept"):
        raise ValueError(f"unknown loss denominator {denominator!r}; expected batch or kept")
    masked = token_loss * loss_mask
    zero = token_loss.new_zeros(())
    if mode == "token-mean":
        if denominator == "kept":  # each CP rank counts its own part of the tokens
            return masked.sum(), loss_mask.sum()
        if response_tokens is None:
            raise ValueError("token-mean with the batch denominator needs each sequence's response tokens")
        count = response_tokens.to(token_loss.dtype).clamp(min=1).sum()
        return masked.sum(), count if count_sequences else zero
    tokens_per_seq = loss_mask.sum(dim=1) if seq_tokens is None else seq_tokens.to(loss_mask.dtype)
    has_tokens = tokens_per_seq > 0
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / tokens_per_seq.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = masked.sum(dim=1)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}")
    rows = has_tokens.sum() if denominator == "kept" else token_loss.new_tensor(token_loss.shape[0])
    return (per_seq * has_tokens).sum(), rows.to(token_loss.dtype) if count_sequences else zero


def policy_loss(logp_theta: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                is_weights: torch.Tensor, loss_mask: torch.Tensor, algo: AlgorithmConfig,
                logp_ref: Optional[torch.Tensor] = None, entropy: Optional[torch.Tensor] = None,
                response_tokens: Optional[torch.Tensor] = None, seq_tokens: Optional[torch.Tensor] = None,
                count_sequences: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Corrected PPO loss of one micro-batch.

    Args:
        logp_theta: ``[batch, tokens]`` current learner logprobs (carries the gradient).
        logp_old: ``[batch, tokens]`` logprobs of the PPO anchor (dense pi_old, or the sampler's in bypass).
        advantages: ``[batch]`` sequence advantages.
        is_weights, loss_mask: ``[batch, tokens]`` from :func:`~sparse_rl_mega.algo.correction.compute_correction`.
        logp_ref: ``[batch, tokens]`` reference-policy logprobs (needed when ``algo.kl_coef > 0``).
        entropy: ``[batch, tokens]`` entropy of pi_theta per position (needed when ``algo.entropy_coef > 0``).
        response_tokens: ``[batch]`` response tokens per sequence before the correction (``token-mean``
            with the ``batch`` denominator divides by their sum).
        seq_tokens, count_sequences: for a context-parallel part of the sequences, see :func:`aggregate`.
    Returns:
        ``(loss_sum, count, stats)``; ``stats`` are detached sums over kept tokens for metrics.
    """
    pg_loss, clipped = ppo_token_loss(logp_theta, logp_old, advantages.unsqueeze(1), algo.eps_clip_low,
                                      algo.eps_clip_high, algo.dual_clip)
    token_loss = pg_loss * is_weights
    kl = None
    if algo.kl_coef > 0:
        if logp_ref is None:
            raise ValueError("algorithm.kl_coef > 0 needs reference logprobs")
        kl = kl_penalty(logp_theta, logp_ref, algo.kl_estimator)
        token_loss = token_loss + algo.kl_coef * kl
    if algo.entropy_coef > 0:
        if entropy is None:
            raise ValueError("algorithm.entropy_coef > 0 needs the per-token entropy")
        token_loss = token_loss - algo.entropy_coef * entropy
    loss_sum, count = aggregate(token_loss, loss_mask, algo.loss_agg_mode, algo.loss_denominator, response_tokens,
                                seq_tokens, count_sequences)
    with torch.no_grad():
        zero = token_loss.new_zeros(())  # (on the loss's device: the train step stacks the stats)
        stats = {
            "clipped_tokens": (clipped.float() * loss_mask).sum(),
            "kept_tokens": loss_mask.sum(),
            "approx_kl_old_sum": (0.5 * (logp_theta - logp_old).pow(2) * loss_mask).sum(),
            "entropy_sum": (entropy * loss_mask).sum() if entropy is not None else zero,
            "kl_ref_sum": (kl * loss_mask).sum() if kl is not None else zero,
        }
    return loss_sum, count, stats
