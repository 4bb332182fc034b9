"""Sparsity correction and PPO loss against independent float64 loop implementations."""
import math

import pytest
import torch

from sparse_rl_mega.algo.advantages import grpo_advantages
from sparse_rl_mega.algo.correction import compute_correction
from sparse_rl_mega.algo.loss import policy_loss
from sparse_rl_mega.config import CorrectionConfig

PAPER = CorrectionConfig()  # defaults are the paper's reference settings


def _random_batch(seed=0, batch=6, tokens=9):
    g = torch.Generator().manual_seed(seed)
    logp_sparse = -torch.rand(batch, tokens, generator=g) * 3
    logp_old = logp_sparse + torch.randn(batch, tokens, generator=g) * 0.5
    logp_old[1, 3] = logp_sparse[1, 3] - 12.0  # rho ~ 6e-6 < 1e-4: sequence 1 is vetoed
    mask = torch.ones(batch, tokens)
    mask[2, 6:] = 0
    mask[4, 2:] = 0
    return logp_old, logp_sparse, mask


def _reference(logp_old, logp_sparse, mask, cfg):
    """Loops over tokens in float64, written from method.md."""
    batch, tokens = mask.shape
    rho = [[math.exp(max(-20, min(20, float(logp_old[i, t]) - float(logp_sparse[i, t])))) for t in range(tokens)]
           for i in range(batch)]
    keep = [[0.0] * tokens for _ in range(batch)]
    weight = [[0.0] * tokens for _ in range(batch)]
    for i in range(batch):
        valid = [t for t in range(tokens) if mask[i, t] > 0]
        vetoed = any(rho[i][t] < cfg.seq_veto_threshold for t in valid)
        for t in valid:
            inside = cfg.token_reject_low <= rho[i][t] <= cfg.token_reject_high
            keep[i][t] = 0.0 if vetoed or not inside else 1.0
            weight[i][t] = min(rho[i][t], cfg.is_truncate)
    count = sum(1 for i in range(batch) for t in range(tokens) if mask[i, t] > 0)
    mean = sum(weight[i][t] for i in range(batch) for t in range(tokens)) / count
    weight = [[w / mean for w in row] for row in weight]
    return torch.tensor(weight, dtype=torch.float64), torch.tensor(keep, dtype=torch.float64)


def test_matches_loop_reference():
    logp_old, logp_sparse, mask = _random_batch()
    weights, loss_mask, metrics = compute_correction(logp_old, logp_sparse, mask, PAPER)
    ref_w, ref_keep = _reference(logp_old, logp_sparse, mask, PAPER)
    assert torch.allclose(weights.double(), ref_w, atol=1e-5)
    assert torch.equal(loss_mask.double(), ref_keep)
    assert loss_mask[1].sum() == 0  # the vetoed sequence
    assert metrics["correction/veto_fraction"] == pytest.approx(1 / 6)
    # batch-normalised: mean 1 over the original response tokens
    assert float((weights * mask).sum() / mask.sum()) == pytest.approx(1.0, abs=1e-6)


def test_identity_when_sampler_equals_old_policy():
    _, logp, mask = _random_batch(seed=3)
    weights, loss_mask, metrics = compute_correction(logp.clone(), logp, mask, PAPER)
    assert torch.equal(weights, mask) and torch.equal(loss_mask, mask)
    assert metrics["correction/veto_fraction"] == 0 and metrics["correction/token_rejected_fraction"] == 0
    assert metrics["mismatch/k3"] == pytest.approx(0.0, abs=1e-12)


def test_mismatch_metrics_match_formulas():
    logp_old, logp_sparse, mask = _random_batch(seed=5)
    _, _, metrics = compute_correction(logp_old, logp_sparse, mask, PAPER)
    lr = (logp_old - logp_sparse).double()[mask > 0]
    k3 = (torch.exp(lr) - 1 - lr).mean()
    assert metrics["mismatch/k3"] == pytest.approx(float(k3), rel=1e-5)
    assert metrics["mismatch/k1"] == pytest.approx(float((-lr).mean()), rel=1e-5)


def test_vetoed_and_rejected_tokens_get_zero_gradient():
    logp_old, logp_sparse, mask = _random_batch(seed=1)
    weights, loss_mask, _ = compute_correction(logp_old, logp_sparse, mask, PAPER)
    rejected = (mask > 0) & (loss_mask == 0)
    assert rejected.any() and (loss_mask > 0).any()
    logp_theta = (logp_old + 0.05).clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 0.7])
    loss_sum, count, _ = policy_loss(logp_theta, logp_old, advantages, weights, loss_mask, eps_clip_low=0.2,
                                     eps_clip_high=0.2, agg_mode="seq-mean-token-mean")
    (loss_sum / count).backward()
    assert torch.all(logp_theta.grad[rejected] == 0)
    assert torch.all(logp_theta.grad[1] == 0)  # vetoed sequence
    assert (logp_theta.grad[loss_mask > 0] != 0).any()


def test_policy_loss_matches_loop_reference():
    g = torch.Generator().manual_seed(7)
    logp_old = -torch.rand(3, 5, generator=g)
    logp_theta = logp_old + torch.randn(3, 5, generator=g) * 0.3
    weights = torch.rand(3, 5, generator=g) + 0.5
    loss_mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    adv = torch.tensor([0.8, -1.2, 0.0])
    for mode in ("seq-mean-token-mean", "token-mean"):
        loss_sum, count, _ = policy_loss(logp_theta, logp_old, adv, weights, loss_mask, eps_clip_low=0.2,
                                         eps_clip_high=0.28, agg_mode=mode)
        per_seq, total, kept = [], 0.0, 0
        for i in range(3):
            terms = []
            for t in range(5):
                if loss_mask[i, t] == 0:
                    continue
                r = math.exp(float(logp_theta[i, t] - logp_old[i, t]))
                a = float(adv[i])
                pg = max(-r * a, -min(max(r, 0.8), 1.28) * a) * float(weights[i, t])
                terms.append(pg)
            total += sum(terms)
            kept += len(terms)
            if terms:
                per_seq.append(sum(terms) / len(terms))
        expected = sum(per_seq) / len(per_seq) if mode == "seq-mean-token-mean" else total / kept
        assert float(loss_sum / count) == pytest.approx(expected, rel=1e-5)


def test_grpo_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4)
    group = [1.0, 0.0, 0.0, 1.0]
    mean = sum(group) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in group) / 3)
    assert adv[0].item() == pytest.approx((1 - mean) / (std + 1e-6), rel=1e-6)
    assert torch.all(adv[4:] == 0)  # a group with equal rewards carries no signal
