"""Correction, PPO loss and advantages against independent float64 loop implementations."""
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparse_rl_mega.algo.advantages import grpo_advantages
from sparse_rl_mega.algo.correction import compute_correction
from sparse_rl_mega.algo.loss import policy_loss, ppo_token_loss
from sparse_rl_mega.config import CORRECTION_PRESETS, AlgorithmConfig, CorrectionConfig, ConfigError, config_from_dict

B, T = 6, 9


def _batch(seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    logp_sparse = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp_old = logp_sparse + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    logp_old[1, 3] = logp_sparse[1, 3] - 12.0  # rho ~ 6e-6: sequence 1 is vetoed by a 1e-4 veto
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[2, 6:] = 0
    mask[4, 2:] = 0
    mask[5, :] = 0  # an empty row (all padding)
    return logp_old, logp_sparse, mask


# ----------------------------------------------------------------------------- loop reference
def _div(lr, est):
    return {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1 - lr}[est]


def _outside(x, low, high):
    return (low is not None and x < low) or (high is not None and x > high)


def reference_correction(logp_old, logp_sparse, mask, c: CorrectionConfig):
    """Token loops over Python floats, written from the docstring formulas."""
    weights = [[0.0] * T for _ in range(B)]
    keep = [[0.0] * T for _ in range(B)]
    seq_weight = {}
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t] > 0]
        if not valid:
            continue
        raw = {t: float(logp_old[i, t] - logp_sparse[i, t]) for t in valid}
        lr = {t: max(-c.log_ratio_bound, min(c.log_ratio_bound, raw[t])) for t in valid}
        seq_sum = sum(lr.values())
        level_value = {"sequence": seq_sum, "geometric": seq_sum / len(valid)}
        drop = c.seq_veto_threshold is not None and any(math.exp(raw[t]) < c.seq_veto_threshold for t in valid)
        if c.reject_level in level_value:
            drop |= _outside(math.exp(level_value[c.reject_level]), c.reject_low, c.reject_high)
        if c.kl_reject_threshold is not None and c.kl_reject_agg != "token":
            d = [_div(lr[t], c.kl_reject_estimator) for t in valid]
            agg = {"seq_sum": abs(sum(d)), "seq_mean": abs(sum(d)) / len(d), "seq_max": max(abs(x) for x in d)}
            drop |= agg[c.kl_reject_agg] > c.kl_reject_threshold
        for t in valid:
            rejected = c.reject_level == "token" and _outside(math.exp(lr[t]), c.reject_low, c.reject_high)
            if c.kl_reject_threshold is not None and c.kl_reject_agg == "token":
                rejected |= abs(_div(lr[t], c.kl_reject_estimator)) > c.kl_reject_threshold
            keep[i][t] = 0.0 if (drop or rejected) else 1.0
            if c.is_level == "none":
                weights[i][t] = 1.0
                continue
            log_w = lr[t] if c.is_level == "token" else max(-c.log_ratio_bound,
                                                              min(c.log_ratio_bound, level_value[c.is_level]))
            w = math.exp(log_w)
            if c.is_mode == "truncate":
                w = min(w, c.is_high)
            elif c.is_mode == "clip":
                w = min(max(w, c.is_low), c.is_high)
            elif _outside(w, c.is_low, c.is_high):
                w = 0.0
            weights[i][t] = w
            seq_weight[i] = w
    if c.is_level != "none" and c.is_batch_normalize:
        if c.is_level == "token":
            flat = [weights[i][t] for i in range(B) for t in range(T) if mask[i, t] > 0]
        else:
            flat = list(seq_weight.values())
        mean = sum(flat) / len(flat)
        weights = [[w / mean for w in row] for row in weights]
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(keep, dtype=torch.float64)


CASES = [
    CorrectionConfig.from_preset("sparse_rl"),
    CorrectionConfig.from_preset("tis"),
    CorrectionConfig.from_preset("icepop"),
    CorrectionConfig.from_preset("naive"),
    CorrectionConfig.from_preset("custom", is_level="sequence", is_mode="truncate", is_high=3.0,
                                 reject_level="sequence", reject_low=0.2, reject_high=5.0),
    CorrectionConfig.from_preset("custom", is_level="geometric", is_mode="clip", is_low=0.8, is_high=1.2,
                                 reject_level="geometric", reject_low=0.7, reject_high=1.25, seq_veto_threshold=None),
    CorrectionConfig.from_preset("custom", is_level="token", is_mode="clip", is_low=0.7, is_high=1.4,
                                 is_batch_normalize=False, reject_level="none"),
    CorrectionConfig.from_preset("custom", is_level="sequence", is_mode="mask", is_low=0.1, is_high=4.0,
                                 reject_level="none", seq_veto_threshold=None),
] + [
    CorrectionConfig.from_preset("custom", reject_level="none", kl_reject_estimator=est, kl_reject_agg=agg,
                                 kl_reject_threshold=thr)
    for est, agg, thr in [("k1", "token", 0.4), ("k2", "token", 0.1), ("k3", "token", 0.1), ("k1", "seq_sum", 1.0),
                          ("k2", "seq_mean", 0.1), ("k3", "seq_max", 0.5), ("k3", "seq_sum", 1.5)]
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.preset}-{c.is_level}-{c.is_mode}-{c.reject_level}-"
                                                    f"{c.kl_reject_estimator}{c.kl_reject_agg}{c.kl_reject_threshold}")
def test_matches_loop_reference(cfg):
    logp_old, logp_sparse, mask = _batch()
    weights, loss_mask, _ = compute_correction(logp_old, logp_sparse, mask, cfg)
    ref_w, ref_keep = reference_correction(logp_old, logp_sparse, mask, cfg)
    assert torch.equal(loss_mask, ref_keep)
    assert torch.allclose(weights, ref_w, rtol=1e-10, atol=1e-12)


def test_reference_cases_are_not_trivial():
    """Each rejection option above rejects something and keeps something on this batch."""
    logp_old, logp_sparse, mask = _batch()
    for cfg in CASES:
        if cfg.reject_level == "none" and cfg.kl_reject_threshold is None and cfg.seq_veto_threshold is None:
            continue
        _, loss_mask, _ = compute_correction(logp_old, logp_sparse, mask, cfg)
        assert 0 < loss_mask.sum() < mask.sum(), cfg


@pytest.mark.parametrize("preset", list(CORRECTION_PRESETS))
def test_identity_when_sampler_equals_old_policy(preset):
    _, logp, mask = _batch(seed=3)
    weights, loss_mask, metrics = compute_correction(logp.clone(), logp, mask, preset)
    assert torch.equal(weights, mask) and torch.equal(loss_mask, mask)
    assert metrics["correction/veto_fraction"] == 0 and metrics["correction/token_rejected_fraction"] == 0
    assert metrics["mismatch/k3"] == pytest.approx(0.0, abs=1e-12)


def test_sparse_rl_preset_is_the_paper():
    c = CorrectionConfig.from_preset("sparse_rl")
    assert (c.is_level, c.is_mode, c.is_high, c.is_batch_normalize) == ("token", "truncate", 1.5, True)
    assert (c.reject_level, c.reject_low, c.reject_high, c.seq_veto_threshold) == ("token", 0.5, 1.5, 1e-4)
    assert c == CorrectionConfig()  # the default is the paper's method


def test_yaml_preset_with_override():
    raw = {"model": {"path": "m", "arch": {}}, "data": {"train_path": "d.jsonl", "prompts_per_iteration": 4},
           "rollout": {"n_samples_per_prompt": 4}, "trainer": {"global_batch_size": 16},
           "algorithm": {"correction": {"preset": "tis", "is_high": 3.0}}}
    c = config_from_dict(raw).algorithm.correction
    assert (c.preset, c.is_high, c.is_level, c.reject_level) == ("tis", 3.0, "token", "none")
    raw["algorithm"]["correction"] = {"preset": "bypass", "is_level": "token"}
    with pytest.raises(ConfigError, match="algorithm.correction.old_policy"):
        config_from_dict(raw)


def test_mismatch_metrics_match_formulas():
    logp_old, logp_sparse, mask = _batch(seed=5)
    _, _, metrics = compute_correction(logp_old, logp_sparse, mask, "naive")
    lr = (logp_old - logp_sparse).clamp(-20, 20)[mask > 0]
    assert metrics["mismatch/k1"] == pytest.approx(float((-lr).mean()), rel=1e-12)
    assert metrics["mismatch/k2"] == pytest.approx(float((0.5 * lr ** 2).mean()), rel=1e-12)
    assert metrics["mismatch/k3"] == pytest.approx(float((lr.exp() - 1 - lr).mean()), rel=1e-12)


def test_rejections_by_side_and_log_rho_quantiles():
    """Which side of [0.5, 1.5] the rejected tokens fell on (counted from rho directly), and the quantiles of log rho against numpy's ``lower``
    quantile of the same tokens: at most one histogram bin below it."""
    import numpy as np

    from sparse_rl_mega.algo.correction import LOG_RHO_BIN

    logp_old, logp_sparse, mask = _batch(seed=5, scale=0.8)
    _, _, metrics = compute_correction(logp_old, logp_sparse, mask, "sparse_rl")
    rho = (logp_old - logp_sparse).exp()[mask > 0]
    low, high = float((rho < 0.5).sum()) / rho.numel(), float((rho > 1.5).sum()) / rho.numel()
    assert low > 0 and high > 0
    assert metrics["correction/token_rejected_low_fraction"] == pytest.approx(low, rel=1e-12)
    assert metrics["correction/token_rejected_high_fraction"] == pytest.approx(high, rel=1e-12)
    assert metrics["correction/token_rejected_fraction"] == pytest.approx(low + high, rel=1e-12)
    log_rho = (logp_old - logp_sparse)[mask > 0].numpy()
    for q in (1, 5, 50):
        expected = float(np.quantile(log_rho, q / 100, method="lower"))
        assert expected - LOG_RHO_BIN - 1e-9 <= metrics[f"mismatch/log_rho_p{q}"] <= expected + 1e-9, q


def test_vetoed_and_rejected_tokens_get_zero_gradient():
    logp_old, logp_sparse, mask = _batch(seed=1)
    weights, loss_mask, _ = compute_correction(logp_old, logp_sparse, mask, "sparse_rl")
    rejected = (mask > 0) & (loss_mask == 0)
    assert rejected.any() and (loss_mask > 0).any()
    logp_theta = (logp_old + 0.05).clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 0.7], dtype=torch.float64)
    algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0)
    entropy = torch.rand(B, T, dtype=torch.float64)
    loss_sum, count, _ = policy_loss(logp_theta, logp_old, advantages, weights, loss_mask, algo,
                                     logp_ref=logp_old - 0.1, entropy=entropy)
    (loss_sum / count).backward()
    assert torch.all(logp_theta.grad[rejected] == 0)
    assert torch.all(logp_theta.grad[1] == 0)  # the vetoed sequence
    assert (logp_theta.grad[loss_mask > 0] != 0).all()


def test_truncation_caps_the_weights_at_the_bound():
    """Ratios far above the truncation bound U come out as exactly U; with a much larger bound the same
    tokens keep their raw ratios, so the cap is what bounds them. tis: U = 2, no normalisation, no
    rejection, so the weights returned are the truncated ones themselves."""
    ratios = torch.tensor([[0.6, 1.0, 1.3, 5.0, 40.0, 3000.0]], dtype=torch.float64)
    logp_sparse = torch.full_like(ratios, -2.5)
    logp_old = logp_sparse + ratios.log()
    mask = torch.ones_like(ratios)
    tis = CorrectionConfig.from_preset("tis")
    assert (tis.is_mode, tis.is_high, tis.is_batch_normalize) == ("truncate", 2.0, False)
    above = ratios > 2.0
    assert above.any() and (~above).any()

    weights, loss_mask, metrics = compute_correction(logp_old, logp_sparse, mask, tis)
    assert torch.equal(loss_mask, mask)
    assert torch.all(weights[above] == 2.0)
    assert torch.allclose(weights[~above], ratios[~above], rtol=1e-12, atol=0)
    assert metrics["correction/is_weight_max"] == 2.0

    loose, _, _ = compute_correction(logp_old, logp_sparse, mask, CorrectionConfig.from_preset("tis", is_high=1e6))
    assert torch.allclose(loose, ratios, rtol=1e-12, atol=0)
    assert torch.all(loose[above] > 2 * 2.0)  # untruncated, these weights would be far above the bound

    # sparse_rl (U = 1.5): truncation comes before the batch normalisation
    normalised, _, _ = compute_correction(logp_old, logp_sparse, mask, "sparse_rl")
    capped = ratios.clamp(max=1.5)
    assert torch.allclose(normalised, capped / capped.mean(), rtol=1e-12, atol=0)

    # sequence level: the sequence's weight prod_t rho_t (here 1.3 * 5 * 40) is capped as a whole
    seq = CorrectionConfig.from_preset("tis", is_level="sequence")
    row_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float64)
    seq_weights, _, _ = compute_correction(logp_old.expand(2, -1), logp_sparse.expand(2, -1), row_mask, seq)
    assert torch.equal(seq_weights[0], 2.0 * row_mask[0])
    assert torch.allclose(seq_weights[1], 0.6 * row_mask[1], rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- PPO part
def _loop_loss(logp_theta, logp_old, logp_ref, entropy, adv, w, keep, response, algo):
    """The step loss written out: per token, then per sequence, then the denominator."""
    per_seq, tokens = [], []
    for i in range(logp_theta.shape[0]):
        terms = []
        for t in range(logp_theta.shape[1]):
            if keep[i, t] == 0:
                continue
            r = math.exp(float(logp_theta[i, t] - logp_old[i, t]))
            a = float(adv[i])
            pg = max(-r * a, -min(max(r, 1 - algo.eps_clip_low), 1 + algo.eps_clip_high) * a)
            if algo.dual_clip is not None and a < 0:
                pg = min(pg, -algo.dual_clip * a)
            d = float(logp_theta[i, t] - logp_ref[i, t])
            kl = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d,
                  "low_var_kl": min(math.exp(-d) - 1 + d, 10.0)}[algo.kl_estimator]
            terms.append(float(w[i, t]) * pg + algo.kl_coef * kl - algo.entropy_coef * float(entropy[i, t]))
        tokens += terms
        if terms:
            per_seq.append((sum(terms) / len(terms), sum(terms)))
    rows = logp_theta.shape[0]
    if algo.loss_agg_mode == "token-mean":  # batch: every response token, at least one per sequence
        return sum(tokens) / (len(tokens) if algo.loss_denominator == "kept"
                              else sum(max(int(response[i].sum()), 1) for i in range(rows)))
    sequences = len(per_seq) if algo.loss_denominator == "kept" else rows
    if algo.loss_agg_mode == "seq-mean-token-mean":
        return sum(m for m, _ in per_seq) / sequences
    return sum(s for _, s in per_seq) / sequences


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("dual_clip", [None, 2.0])
@pytest.mark.parametrize("denominator", ["batch", "kept"])
def test_policy_loss_matches_loop_reference(agg, kl_estimator, dual_clip, denominator):
    g = torch.Generator().manual_seed(7)
    shape = (4, 6)
    logp_old = -torch.rand(shape, generator=g, dtype=torch.float64)
    logp_theta = logp_old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.6
    logp_ref = logp_old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.2
    entropy = torch.rand(shape, generator=g, dtype=torch.float64)
    weights = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    response = torch.ones(shape, dtype=torch.float64)
    response[0, 4:] = 0  # padding
    keep = (torch.rand(shape, generator=g) > 0.3).double() * response
    keep[3] = 0  # a sequence the correction dropped
    adv = torch.tensor([0.8, -1.2, -3.0, 1.0], dtype=torch.float64)
    algo = AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28, dual_clip=dual_clip, kl_coef=0.07,
                           kl_estimator=kl_estimator, entropy_coef=0.03, loss_agg_mode=agg,
                           loss_denominator=denominator)
    loss_sum, count, stats = policy_loss(logp_theta, logp_old, adv, weights, keep, algo, logp_ref=logp_ref,
                                         entropy=entropy, response_tokens=response.sum(dim=1))
    expected = _loop_loss(logp_theta, logp_old, logp_ref, entropy, adv, weights, keep, response, algo)
    assert float(loss_sum / count) == pytest.approx(expected, rel=1e-12)
    assert 0 < stats["clipped_tokens"] < stats["kept_tokens"]


def test_low_var_kl_is_k3_capped_at_10():
    """slime's low_var_kl: k3 = rho - 1 - log rho (rho = pi_ref / pi_theta) clamped to [-10, 10]; past
    the cap the token gives no KL gradient."""
    from sparse_rl_mega.algo.loss import kl_penalty

    log_rho = torch.tensor([-3.0, -0.5, 0.0, 0.7, 2.0, 3.0], dtype=torch.float64)  # log pi_ref - log pi_theta
    logp_theta = torch.full_like(log_rho, -2.0).requires_grad_(True)
    kl = kl_penalty(logp_theta, logp_theta.detach() + log_rho, "low_var_kl")
    k3 = log_rho.exp() - 1 - log_rho
    assert k3[-1] > 10 and (k3[:-1] < 10).all()
    assert torch.allclose(kl, k3.clamp(max=10.0), rtol=1e-12, atol=0)
    kl.sum().backward()
    assert logp_theta.grad[-1] == 0 and (logp_theta.grad[:2] != 0).all()


def test_dual_clip_caps_the_loss_of_negative_advantages():
    """A token with A < 0 whose ratio exploded: PPO clipping alone leaves its loss at -r A (growing with
    r), the dual clip caps it at -c A = c |A| (a positive loss, constant in theta). A < 0 with a small
    ratio and A > 0 are left alone."""
    c, eps = 3.0, 0.2
    log_r = torch.tensor([[6.0], [6.0], [0.05], [6.0]], dtype=torch.float64)  # r = e^6 ~ 403
    adv = torch.tensor([-2.0, -0.5, -2.0, 1.5], dtype=torch.float64)
    r = log_r.exp()
    logp_old = torch.full_like(log_r, -1.0)
    logp_theta = (logp_old + log_r).requires_grad_(True)
    ones = torch.ones_like(log_r)

    capped, clipped = ppo_token_loss(logp_theta, logp_old, adv.unsqueeze(1), eps, eps, dual_clip=c)
    uncapped, _ = ppo_token_loss(logp_theta, logp_old, adv.unsqueeze(1), eps, eps, dual_clip=None)
    expected = torch.tensor([[c * 2.0], [c * 0.5], [2.0 * float(r[2, 0])], [-(1 + eps) * 1.5]], dtype=torch.float64)
    assert torch.equal(capped[:2], expected[:2])  # exactly c |A|
    assert torch.allclose(capped, expected, rtol=1e-12, atol=0)
    assert torch.allclose(uncapped[:2], -r[:2] * adv[:2, None], rtol=1e-12, atol=0)
    assert torch.all(uncapped[:2] > 50 * capped[:2])  # without the dual clip: -r A, ~134 times c |A|
    assert torch.equal(uncapped[2:], capped[2:])
    assert clipped.squeeze(1).tolist() == [True, True, False, True]

    # through policy_loss: one token per sequence, summed
    algo = AlgorithmConfig(eps_clip_low=eps, eps_clip_high=eps, dual_clip=c, loss_agg_mode="seq-mean-token-sum")
    loss_sum, count, stats = policy_loss(logp_theta, logp_old, adv, ones, ones, algo)
    assert count == 4 and stats["clipped_tokens"] == 3
    assert float(loss_sum) == pytest.approx(float(expected.sum()), rel=1e-12)
    loss_sum.backward()
    assert logp_theta.grad[:2].abs().max() == 0 and logp_theta.grad[2] != 0  # the capped tokens give no gradient
    off = AlgorithmConfig(eps_clip_low=eps, eps_clip_high=eps, dual_clip=None, loss_agg_mode="seq-mean-token-sum")
    assert float(policy_loss(logp_theta, logp_old, adv, ones, ones, off)[0]) > 100 * float(loss_sum)


# ----------------------------------------------------------------------------- advantages
def test_grpo_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = grpo_advantages(rewards, 4)
    group = [1.0, 0.0, 0.0, 1.0]
    mean = sum(group) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in group) / 3)
    assert adv[0].item() == pytest.approx((1 - mean) / (std + 1e-6), rel=1e-6)
    assert torch.all(adv[4:] == 0)  # a group with equal rewards carries no signal
    assert grpo_advantages(rewards, 4, std_normalize=False)[0].item() == pytest.approx(0.5)


def test_grpo_advantages_after_rejection_use_survivors_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    valid = torch.tensor([True, True, False, False])
    adv = grpo_advantages(rewards, 4, valid=valid)
    # survivors 1.0 and 0.0: mean 0.5, unbiased std sqrt(0.5)
    assert adv.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0.0, 0.0])


# ----------------------------------------------------------------------------- data parallel
def _dp_worker(rank, init_file, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    logp_old, logp_sparse, mask = _batch(seed=11, scale=0.3)
    rows = slice(0, 3) if rank == 0 else slice(3, 6)
    out = {}
    for preset in ("sparse_rl", "icepop"):
        for level in ("token", "sequence"):
            cfg = CorrectionConfig.from_preset(preset, is_level=level) if preset == "sparse_rl" else preset
            w, m, metrics = compute_correction(logp_old[rows], logp_sparse[rows], mask[rows], cfg,
                                               group=dist.group.WORLD)
            out[f"{preset}-{level}"] = (w, m, metrics)
    torch.save(out, f"{result_file}.{rank}")
    dist.destroy_process_group()


def test_data_parallel_split_equals_whole_batch():
    """Batch normalisation and metrics over two gloo ranks equal one process over the whole batch."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result")
        mp.spawn(_dp_worker, args=(init_file, result_file), nprocs=2)
        parts = [torch.load(f"{result_file}.{r}") for r in (0, 1)]
    logp_old, logp_sparse, mask = _batch(seed=11, scale=0.3)
    for key in parts[0]:
        preset, level = key.split("-")
        cfg = CorrectionConfig.from_preset(preset, is_level=level) if preset == "sparse_rl" else preset
        w, m, metrics = compute_correction(logp_old, logp_sparse, mask, cfg)
        assert torch.allclose(torch.cat([parts[0][key][0], parts[1][key][0]]), w, rtol=1e-12, atol=1e-14)
        assert torch.equal(torch.cat([parts[0][key][1], parts[1][key][1]]), m)
        for name, value in metrics.items():
            assert parts[0][key][2][name] == pytest.approx(value, rel=1e-12, abs=1e-15), (key, name)
            assert parts[1][key][2][name] == parts[0][key][2][name]


def test_sampling_supports_reach_the_label_positions_they_were_drawn_at():
    """pack_samples keeps each sample's supports compact (counts + ids per row); a selection of rows and
    padded_supports give back, at each response token's label position, exactly the ids it was drawn
    among (-1 padding, nothing off the response); support_mask marks them on each TP rank's slice of
    the vocabulary, and every token of a position without a support."""
    from sparse_rl_mega.batch import GeneratedSample, pack_samples
    from sparse_rl_mega.learner.vocab_parallel import support_mask

    samples = [GeneratedSample(0, [1, 2, 3], [7, 8], [-0.1, -0.2], "", "stop", support=[[7, 9], [8, 1, 2, 30]]),
               GeneratedSample(0, [4, 5], [6, 7, 9], [-0.3, 0.0, -0.5], "", "stop", support=[[6], [7, 31], [9, 0]])]
    batch = pack_samples(samples, [1.0, 0.0], temperature=0.6)
    assert batch.temperature == 0.6 and batch.support_counts.tolist() == [[0, 0, 2, 4], [0, 1, 2, 2]]
    assert [ids.numel() for ids in batch.support_ids] == [6, 5]
    padded = batch.select([1, 0]).padded_supports(slice(0, 2))  # [2, S, K]: K the widest, 4
    assert padded.shape == (2, 4, 4) and padded.dtype == torch.int32
    assert padded[1, 2].tolist() == [7, 9, -1, -1] and padded[1, 3].tolist() == [8, 1, 2, 30]
    assert padded[0, 1].tolist() == [6, -1, -1, -1] and padded[0, 3].tolist() == [9, 0, -1, -1]
    assert (padded[:, 0] == -1).all() and (padded[1, 1] == -1).all()
    vocab = 32
    for start, width in ((0, 16), (16, 16)):  # TP2: each rank's slice
        mask = support_mask(padded, start, width)
        for row in range(2):
            for pos in range(4):
                ids = [int(v) for v in padded[row, pos] if v >= 0]
                want = [start <= v < start + width for v in range(vocab)] if not ids else \
                    [v in ids and start <= v < start + width for v in range(vocab)]
                assert mask[row, pos].tolist() == want[start:start + width], (start, row, pos)
    with pytest.raises(ValueError, match="sample 0 has 1 sampling supports for its 2 response tokens"):
        pack_samples([GeneratedSample(0, [1], [7, 8], [0.0, 0.0], "", "stop", support=[[7]])], [0.0])


# ----------------------------------------------------------------------------- device discipline
# A GPU step runs the loss and its report on CUDA; here on a CPU every tensor is on one device, so
# these run with their inputs on another one (tests/helpers/other_device.py): a tensor made on the
# CPU inside them (torch.tensor(n), torch.zeros(())) fails the op that meets it, as CUDA's would.
def _step_inputs(g, rows=4, width=7, vocab=11):
    from sparse_rl_mega.batch import RolloutBatch

    ids = torch.randint(0, vocab, (rows, width + 1), generator=g)
    response = torch.zeros(rows, width)
    response[:, 3:] = 1
    response[0, 6:] = 0
    batch = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=response,
                         logp_sparse=-torch.rand(rows, width, generator=g) * response, rewards=torch.rand(rows, generator=g),
                         group_ids=torch.zeros(rows, dtype=torch.long), temperature=0.7)
    batch.logp_old = batch.logp_sparse + 0.3 * torch.randn(rows, width, generator=g) * response
    batch.advantages = torch.randn(rows, generator=g)
    batch.is_weights, batch.loss_mask, _ = compute_correction(batch.logp_old, batch.logp_sparse, response, "sparse_rl")
    batch.loss_mask[1] = 0  # a dropped sequence
    return batch, torch.randn(rows, width, vocab, generator=g)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("denominator", ["batch", "kept"])
@pytest.mark.parametrize("kl_entropy", [False, True])
def test_loss_and_its_stats_stay_on_the_inputs_device(agg, denominator, kl_entropy):
    from tests.helpers.other_device import OtherDevice, assert_on_other_device, on_other_device

    g = torch.Generator().manual_seed(11)
    shape = (4, 6)
    inputs = [-torch.rand(shape, generator=g), -torch.rand(shape, generator=g), torch.randn(4, generator=g),
              torch.rand(shape, generator=g), (torch.rand(shape, generator=g) > 0.3).float(),
              -torch.rand(shape, generator=g), torch.rand(shape, generator=g), torch.full((4,), 6.0)]
    algo = AlgorithmConfig(loss_agg_mode=agg, loss_denominator=denominator, kl_coef=0.1 if kl_entropy else 0.0,
                           entropy_coef=0.01 if kl_entropy else 0.0)
    with OtherDevice():
        theta, old, adv, w, keep, ref, entropy, response = map(on_other_device, inputs)
        theta.requires_grad_()
        loss_sum, count, stats = policy_loss(theta, old, adv, w, keep, algo, logp_ref=ref if kl_entropy else None,
                                             entropy=entropy if kl_entropy else None, response_tokens=response)
        assert_on_other_device((loss_sum, count, stats), f"policy_loss {agg}/{denominator}")
        torch.stack([loss_sum, count] + list(stats.values()))  # what the train step's report does
        (loss_sum / count).backward()
        assert_on_other_device(theta.grad, "the gradient")
    plain = policy_loss(*inputs[:5], algo, logp_ref=inputs[5] if kl_entropy else None,
                        entropy=inputs[6] if kl_entropy else None, response_tokens=inputs[7])
    assert float(loss_sum) == pytest.approx(float(plain[0]), rel=1e-6) and float(count) == float(plain[1])


@pytest.mark.parametrize("preset", ["sparse_rl", "tis", "icepop", "naive", "bypass"])
def test_correction_stays_on_the_inputs_device(preset):
    from tests.helpers.other_device import OtherDevice, assert_on_other_device, on_other_device

    g = torch.Generator().manual_seed(12)
    logp_old = -torch.rand(5, 8, generator=g) * 3
    logp_sparse = logp_old + 0.5 * torch.randn(5, 8, generator=g)
    mask = (torch.rand(5, 8, generator=g) > 0.2).float()
    mask[4] = 0  # a row without response tokens
    weights, keep, metrics = compute_correction(logp_old, logp_sparse, mask, preset)
    with OtherDevice():
        w_other, keep_other, m_other = compute_correction(*map(on_other_device, (logp_old, logp_sparse, mask)), preset)
        assert_on_other_device((w_other, keep_other), preset)
        w_other, keep_other = w_other.cpu(), keep_other.cpu()
    assert torch.equal(w_other, weights) and torch.equal(keep_other, keep) and m_other == metrics


def test_train_step_report_stays_on_the_model_device():
    """The train step's loss function (learner/step.py corrected_loss) over micro-batches moved to the
    model's device by _microbatches: its loss, count and report are there, and its report equals the
    same step's on the CPU."""
    from megatron.core import parallel_state as ps

    from sparse_rl_mega.learner.step import REPORT_KEYS, _microbatches, corrected_loss
    from tests.helpers.other_device import DEVICE, OtherDevice, assert_on_other_device, on_other_device

    batch, logits = _step_inputs(torch.Generator().manual_seed(13))
    algo = AlgorithmConfig()  # kl_coef 0: no reference, the stats' zeros are made by the loss
    ps.set_tensor_model_parallel_world_size(1)
    ps.set_tensor_model_parallel_rank(0)
    try:
        mb_cpu, = _microbatches(batch, batch.size, True, batch.width + 2)
        logits_cpu = torch.cat([logits, logits[:, :2]], dim=1)
        want = corrected_loss(algo, batch.temperature, True, mb_cpu, logits_cpu)
        with OtherDevice():
            mb, = _microbatches(batch, batch.size, True, batch.width + 2, device=DEVICE)
            assert_on_other_device(mb, "a micro-batch")
            logits_other = on_other_device(logits_cpu).requires_grad_()
            loss_sum, count, report = corrected_loss(algo, batch.temperature, True, mb, logits_other)
            assert_on_other_device((loss_sum, count, report), "the loss function's outputs")
            total = torch.zeros(len(REPORT_KEYS), dtype=torch.float64, device=DEVICE) + report["report"]
            loss_sum.backward()
            assert_on_other_device(logits_other.grad, "the logits' gradient")
            got = total.tolist()
    finally:
        ps.set_tensor_model_parallel_world_size(None)
        ps.set_tensor_model_parallel_rank(None)
    assert got == pytest.approx(want[2]["report"].tolist(), rel=1e-12) and int(count) == int(want[1])
