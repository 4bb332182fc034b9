"""The learner's gradient of the full corrected loss is the gradient of that loss, at every layout.

One fixed global batch (8 sequences, veto + token rejection + IS truncation + PPO and dual clipping +
k3 KL + entropy bonus all active, sampled at temperature 0.7 and half of it top-k/top-p truncated;
tests/helpers/grad_batch.py) is differentiated by the real Megatron
learner under torchrun (gloo) at several layouts, each with several micro-batches, and every gradient
is gathered in HF names. The reference is independent of Megatron: plain autograd through the
transformers model with the same weights, logprobs and entropy from its logits, the same correction
and ``policy_loss`` on the whole batch at once. In float64 every layout equals it to rounding (a lost
or doubled normaliser, a gradient reduced twice, a dropped micro-batch all show); in float32 each
layout equals it within the float32 rounding bound of the computation (tests/helpers/float_bounds.py),
whatever kernels the CPU runs. The layouts share two torchrun sessions (2 and 4 processes), which
also check that activation recomputation really recomputes and that Megatron's distributed optimizer
shards Adam's state and trains exactly like the replicated one.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
from float_bounds import U32, U64, float64_causal_lm, forward_depth, gamma  # noqa: E402
from grad_batch import ALGORITHM, LOSS_NAMES, LOSSES, N, REJECTED_ROW, VETOED_ROW, WIDTH, fill_loss_inputs, \
    sampled_distribution_logits, synthetic_batch  # noqa: E402

HELPER = ROOT / "tests" / "helpers" / "grad_check.py"
# name: (processes, TP, PP, micro-batch size, more parallel settings); every layout runs >= 2 micro-batches
LAYOUTS = {"DP2": (2, 1, 1, 2, {}), "TP2 (4 micro-batches)": (2, 2, 1, 2, {}), "PP2": (2, 1, 2, 2, {}),
           "TP2 selective recompute": (2, 2, 1, 2, {"recompute": "selective"}),
           "PP2 full recompute": (2, 1, 2, 2, {"recompute": "full"}),
           "PP2 x 2 virtual stages": (2, 1, 2, 2, {"virtual_pipeline_model_parallel_size": 2}),
           "CP2": (2, 1, 1, 2, {"context_parallel_size": 2}),
           "DP2 x CP2": (4, 1, 1, 2, {"context_parallel_size": 2}),
           "TP2 x CP2 selective recompute": (4, 2, 1, 2, {"context_parallel_size": 2, "recompute": "selective"})}
TIED = "tied embeddings, PP2 x 2 virtual stages"
# float32 too (against the float64 reference and against DP2) where the layouts sum differently: TP's
# all-reduced partial sums, the interleaved schedule, CP's split sequences, and all of them at once
FLOAT32_LAYOUTS = ["DP2", "TP2 (4 micro-batches)", "PP2 x 2 virtual stages", "CP2", "TP2 x CP2 selective recompute"]
# The rounding bound of the gradient (relative to its largest entry): the backward pass runs every
# reduction of the forward pass transposed (same lengths) and sums each weight's gradient over the
# batch's tokens, so n = 2 x the forward depth + tokens; the tiny model (4 layers, hidden 64, ffn 128,
# head_dim 16, vocabulary 384, 14 positions, 8 sequences): n = 3808. float64 against transformers: same
# math, other kernels. float32 against the float64 reference: float32 rounding of forward and backward
# (2.3e-4; a bfloat16 or float16 step anywhere is >= 1e-3 off). Two float32 layouts can differ by the
# sum of their own errors only, which these comparisons already bound: they are not compared with each
# other (a bound fitted to one CPU's 3.2e-6 failed at 5.3e-6 and 5.7e-6 on others).
GRAD_TERMS = 2 * forward_depth(4, 64, 128, 16, WIDTH, 384) + N * WIDTH
TOLERANCE = {"float64": gamma(GRAD_TERMS, U64), "float32": gamma(GRAD_TERMS, U32)}
# Megatron divides the gradients by the step's loss count as ``1.0 / num_tokens`` of an int tensor
# (finalize_model_grads): a float32 scalar, so in float64 the whole gradient is off by one float32
# rounding of 1/count (at most u32 = 6e-8; the division by an integer-valued float rounds once more in
# float64); that common factor is compared on its own
SCALE_TOLERANCE = U32 + 2 * U64


def _job(name, model, tp, pp, mbs, parallel, kind="gradient"):
    dtypes = ["float32", "float64"] if name in FLOAT32_LAYOUTS else ["float64"]
    return {"name": name, "kind": kind, "model": str(model), "tp": tp, "pp": pp, "mbs": mbs, "parallel": parallel,
            "dtypes": dtypes}


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    from tests.test_learner import RANDOM_MODELS, _build_random_model

    return _build_random_model(tmp_path_factory.mktemp("tied") / "llama-tied", *RANDOM_MODELS["llama-tied"])


@pytest.fixture(scope="module")
def megatron(tiny_model_dir, tied_model_dir, tmp_path_factory):
    """Every job's result, from one torchrun session per process count."""
    sessions = {}
    for name, (procs, tp, pp, mbs, parallel) in LAYOUTS.items():
        sessions.setdefault(procs, []).append(_job(name, tiny_model_dir, tp, pp, mbs, parallel))
    sessions[2].append(_job(TIED, tied_model_dir, 1, 2, 2, {"virtual_pipeline_model_parallel_size": 2}))
    sessions[2].append(_job("optimizer", tiny_model_dir, 1, 1, 2, {}, kind="optimizer"))
    out_dir, results = tmp_path_factory.mktemp("grads"), {}
    for procs, jobs in sessions.items():
        out = out_dir / f"session{procs}.pt"
        proc = run_torchrun(HELPER, out, json.dumps(jobs), nproc=procs, timeout=600)
        assert proc.returncode == 0, f"{procs} processes: {proc.stderr[-4000:]}"
        results.update(torch.load(out))
    return results


def autograd_reference(model_dir: Path) -> dict:
    """The corrected loss's gradient by plain autograd through transformers (wholly in float64), whole
    batch at once."""
    from sparse_rl_mega.algo.loss import policy_loss
    from sparse_rl_mega.config import AlgorithmConfig

    model = float64_causal_lm(model_dir)
    batch = synthetic_batch(model.config.vocab_size)
    # the distribution the batch was sampled from: temperature, and the truncated rows' supports
    logits = sampled_distribution_logits(model(batch.input_ids).logits, batch)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all.masked_fill(logits == float("-inf"), 0.0)).sum(-1)
    metrics = fill_loss_inputs(batch, logp.detach(), torch.arange(N), batch.rewards)
    out = {"metrics": metrics, "kept_per_row": batch.loss_mask.sum(dim=1).tolist(),
           "response_per_row": batch.response_mask.sum(dim=1).tolist()}

    def differentiate(loss):
        model.zero_grad()
        loss.backward(retain_graph=True)
        return {"loss": float(loss), "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()}}

    for mode, denominator in LOSSES:
        algo = AlgorithmConfig(**ALGORITHM, loss_agg_mode=mode, loss_denominator=denominator)
        loss_sum, count, _ = policy_loss(logp, batch.logp_old, batch.advantages, batch.is_weights, batch.loss_mask,
                                         algo, logp_ref=batch.logp_ref, entropy=entropy,
                                         response_tokens=batch.response_mask.sum(dim=1))
        out[f"{mode}/{denominator}"] = differentiate(loss_sum / count)
    kept = AlgorithmConfig(**ALGORITHM, loss_denominator="kept")  # (today's other denominator, loss only)
    loss_sum, count, _ = policy_loss(logp, batch.logp_old, batch.advantages, batch.is_weights, batch.loss_mask, kept,
                                     logp_ref=batch.logp_ref, entropy=entropy)
    out["seq-mean-token-mean/kept"] = {"loss": float(loss_sum / count)}
    for per_token in (False, True):
        out[f"release/{'per_token' if per_token else 'sample_mean'}"] = differentiate(
            release_loss(logp, entropy, batch, per_token))
    return out


def release_loss(logp, entropy, batch, per_token: bool):
    """The step loss as the paper's release computes it, written as loops from slime's code
    (backends/megatron_utils/loss.py and cp_utils.py of lsjia/Sparse-RL), not from ours.

    policy_loss_function: ``pg = compute_policy_loss(old - new, A, eps, eps_high, eps_c)`` (ratio
    ``exp(new - old)``, clipped surrogate, for A < 0 ``min(-eps_c A, .)``), times the TIS weights the
    Sparse-RL function returns with its rejection mask; ``sum_of_sample_mean`` rebuilt on that mask:
    per sample ``sum(x * m) / clamp_min(sum(m), 1)``, summed over samples (``calculate_per_token_loss``:
    ``sum(x * m)`` only); ``loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss``, each
    reduced alone, KL ``low_var_kl`` = ``clamp(exp(-(new - ref)) - 1 + (new - ref), -10, 10)``.
    loss_function: ``loss * num_microbatches / global_batch_size * dp_size``, which Megatron divides by
    ``num_microbatches`` (per-sample mode) and DDP averages over DP: the step is the sum over every
    sample of the step / ``global_batch_size`` (N here, one step). Per-token mode: the schedule leaves
    the loss as it is and Megatron divides the gradients by ``num_tokens``, summed over micro-batches
    and DP ranks: ``sum_i clamp_min(original loss_mask_i.sum(), 1)``; the release's extra factor
    ``num_microbatches * dp_size / global_batch_size`` (1 / micro_batch_size) is left out, as ours
    leaves it out (docs/algorithm.md)."""
    eps_low, eps_high = 0.2, 0.2  # AlgorithmConfig's defaults, which ALGORITHM keeps
    eps_c, kl_coef, entropy_coef = ALGORITHM["dual_clip"], ALGORITHM["kl_coef"], ALGORITHM["entropy_coef"]
    pg_loss, entropy_loss, kl_loss = 0.0, 0.0, 0.0
    for i in range(N):
        kept = [t for t in range(WIDTH) if batch.loss_mask[i, t] > 0]
        a = batch.advantages[i]
        pg_i, entropy_i, kl_i = 0.0, 0.0, 0.0
        for t in kept:
            ratio = torch.exp(-(batch.logp_old[i, t] - logp[i, t]))
            surrogate = torch.maximum(-ratio * a, -ratio.clamp(1 - eps_low, 1 + eps_high) * a)
            if a < 0:
                surrogate = torch.minimum(-eps_c * a, surrogate)
            pg_i = pg_i + surrogate * batch.is_weights[i, t]
            entropy_i = entropy_i + entropy[i, t]
            log_ratio = -(logp[i, t] - batch.logp_ref[i, t])
            kl_i = kl_i + torch.clamp(log_ratio.exp() - 1 - log_ratio, -10, 10)
        divisor = 1 if per_token else max(len(kept), 1)
        pg_loss, entropy_loss, kl_loss = pg_loss + pg_i / divisor, entropy_loss + entropy_i / divisor, \
            kl_loss + kl_i / divisor
    loss = pg_loss - entropy_coef * entropy_loss + kl_coef * kl_loss
    if per_token:
        return loss / sum(max(int(batch.response_mask[i].sum()), 1) for i in range(N))
    return loss / N


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tied_model_dir):
    return {"tiny": autograd_reference(tiny_model_dir), "tied": autograd_reference(tied_model_dir)}


def _relative_diff(ref: dict, got: dict, factor: float = 1.0) -> float:
    """max |ref - factor * got| / max |ref| over every tensor."""
    assert ref.keys() == got.keys()
    scale = max(float(g.abs().max()) for g in ref.values())
    assert scale > 1e-3, "the gradient must not vanish, or the comparison proves nothing"
    return max(float((ref[k] - factor * got[k].to(ref[k].dtype)).abs().max()) for k in ref) / scale


def _common_factor(ref: dict, got: dict) -> float:
    """The least-squares factor f with ref ~ f * got."""
    dot = sum(float((r * got[k].to(r.dtype)).sum()) for k, r in ref.items())
    return sum(float(r.pow(2).sum()) for r in ref.values()) / dot


def test_the_batch_exercises_every_correction(reference):
    metrics = reference["tiny"]["metrics"]
    assert metrics["correction/veto_fraction"] == pytest.approx(1 / 8)
    assert 0 < metrics["correction/token_rejected_fraction"] < 1
    assert metrics["correction/token_rejected_high_fraction"] > 0 and metrics["correction/token_rejected_low_fraction"] > 0
    assert metrics["correction/is_weight_max"] > 1.5  # truncated at 1.5, then batch-normalised
    kept, response = reference["tiny"]["kept_per_row"], reference["tiny"]["response_per_row"]
    # a vetoed and a wholly rejected row: no token kept, both still rows of the step
    assert [i for i, k in enumerate(kept) if k == 0] == sorted([VETOED_ROW, REJECTED_ROW]) and min(response) > 0


@pytest.mark.parametrize("layout, dtype", [(name, "float64") for name in list(LAYOUTS) + [TIED]]
                         + [(name, "float32") for name in FLOAT32_LAYOUTS])
def test_gradient_equals_autograd_on_transformers(megatron, reference, layout, dtype, record_property):
    ref = reference["tied" if layout == TIED else "tiny"]
    got = megatron[layout][dtype]
    bound = TOLERANCE[dtype]
    for key, value in ref["metrics"].items():  # the same decisions: veto, rejection, weights
        # (functions of the logprobs, which carry at most the forward part of the bound)
        assert got["metrics"][key] == pytest.approx(value, rel=bound, abs=bound), key
    for mode in LOSS_NAMES:
        factor = _common_factor(ref[mode]["grads"], got[mode]["grads"])
        assert abs(factor - 1) <= (SCALE_TOLERANCE if dtype == "float64" else bound), (layout, dtype, mode, factor)
        diff = _relative_diff(ref[mode]["grads"], got[mode]["grads"], factor if dtype == "float64" else 1.0)
        record_property(f"relative_grad_diff.{mode}", diff)  # (--junitxml: the spread across CPUs, docs/testing.md)
        assert diff <= bound, (layout, dtype, mode, diff, bound)
        assert got[mode]["loss"] == pytest.approx(ref[mode]["loss"], rel=bound)
    if layout == TIED:  # one tensor for input and output embedding: their gradients summed across stages
        assert "lm_head.weight" not in got[LOSS_NAMES[0]]["grads"]


# ours (name in LOSS_NAMES) -> the release's reading (release_loss)
RELEASE = {"seq-mean-token-mean/batch": "release/sample_mean", "token-mean/batch": "release/per_token"}


@pytest.mark.parametrize("layout", ["DP2", "PP2"])
def test_the_learner_trains_on_the_release_loss(megatron, reference, layout):
    """Our default loss, as the learner computes it over DP ranks and micro-batches, against the loops
    read from the release's code, in float64: loss and gradient (and our whole-batch policy_loss too)."""
    for ours, release in RELEASE.items():
        ref = reference["tiny"][release]
        for got in (megatron[layout]["float64"][ours], reference["tiny"][ours]):
            assert got["loss"] == pytest.approx(ref["loss"], rel=TOLERANCE["float64"]), (layout, ours)
            factor = _common_factor(ref["grads"], got["grads"])
            assert abs(factor - 1) <= SCALE_TOLERANCE, (layout, ours, factor)
            assert _relative_diff(ref["grads"], got["grads"], factor) <= TOLERANCE["float64"], (layout, ours)


def test_loss_modes_give_different_gradients(reference):
    """Guards the comparisons above: the losses really differ (aggregation, and the denominator that
    counts the vetoed and rejected rows or not)."""
    tiny = reference["tiny"]
    a, b = (tiny[mode]["grads"] for mode in ("seq-mean-token-mean/batch", "token-mean/batch"))
    assert _relative_diff(a, b) > 1e-2
    # the kept denominator: the 6 rows that kept a token carry the whole step, 8/6 of the release's
    assert tiny["seq-mean-token-mean/kept"]["loss"] == pytest.approx(tiny["seq-mean-token-mean/batch"]["loss"] * 8 / 6,
                                                                     rel=1e-12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recomputation_recomputes(megatron, layout):
    """Forward calls in the training pass per call in the no-grad pass: 2 for what is recomputed."""
    recompute = LAYOUTS[layout][4].get("recompute")
    calls = megatron[layout]["float64"][LOSS_NAMES[0]]["forward_calls"]
    assert calls == {"layer": 2.0 if recompute == "full" else 1.0,
                     "core_attention": 1.0 if recompute is None else 2.0}, calls


def test_distributed_optimizer_shards_adam_and_trains_like_the_replicated_one(megatron, tiny_model_dir,
                                                                             record_property):
    """DP2, two optimizer steps: each rank holds Adam's state for half the parameters (not all of them),
    and the weights and step metrics equal the replicated optimizer's. float32, two optimizers that reduce
    the gradients in other orders (reduce-scatter against all-reduce): Adam divides each gradient entry
    by its own running scale, so an entry near 0 can move by up to 2 lr per step whatever the rounding;
    the bounds (1e-6) are of the third kind of docs/testing.md, >= 10x the spread measured across kernels."""
    from sparse_rl_mega.learner.weights import read_hf_state_dict

    plain, sharded = megatron["optimizer"]["replicated"], megatron["optimizer"]["distributed"]
    params = plain["params_per_rank"]
    assert plain["adam_values_per_rank"] == [params, params]
    held = sharded["adam_values_per_rank"]
    assert sum(held) >= params and all(0.4 * params < h < 0.6 * params for h in held), (held, params)
    for before, after in zip(plain["steps"], sharded["steps"], strict=True):
        assert before["train/update_ok"] == after["train/update_ok"] == 1.0
        for key in ("train/loss", "train/grad_norm", "train/entropy"):
            assert after[key] == pytest.approx(before[key], rel=1e-6), key
    assert plain["weights"].keys() == sharded["weights"].keys()
    record_property("max_abs_weight_diff", max(float((sharded["weights"][n] - w).abs().max())
                                               for n, w in plain["weights"].items()))
    for name, weight in plain["weights"].items():
        assert torch.allclose(sharded["weights"][name], weight, rtol=0, atol=1e-6), name
    initial = read_hf_state_dict(tiny_model_dir)  # and the steps did move every weight
    assert all(not torch.equal(initial[name], weight) for name, weight in sharded["weights"].items())


def test_a_non_finite_step_is_skipped_and_training_goes_on(megatron):
    """A NaN in the batch makes loss and gradients NaN: the step is skipped (counted), weights and Adam's
    moments stay bit for bit, and the next finite step trains (replicated and distributed optimizer)."""
    import math

    for name in ("replicated", "distributed"):
        result = megatron["optimizer"][name]["non_finite"]
        skipped, following = result["skipped"], result["following"]
        assert skipped["train/skipped_steps"] == 1.0 and skipped["train/update_ok"] == 0.0, (name, skipped)
        assert not math.isfinite(skipped["train/loss"]) and not math.isfinite(skipped["train/grad_norm"])
        assert result["weights_unchanged"] and result["adam_unchanged"], name
        assert following["train/skipped_steps"] == 0.0 and following["train/update_ok"] == 1.0, (name, following)
        assert math.isfinite(following["train/grad_norm"]) and following["train/grad_norm"] > 0
