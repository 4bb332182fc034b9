"""The fixed global batch of the gradient checks, shared by the Megatron helper (grad_check.py, under
torchrun) and the transformers autograd reference (tests/test_layout_invariance.py). No side effects
on import (no CPU shims, no Megatron).

8 sequences in 2 GRPO groups, prompts and right padding of varying length; the sampler, anchor and
reference logprobs are the model's own dense logprobs plus fixed noise, one token of row 1 is made
~impossible for the anchor (the row is vetoed) and every token of row 6 is e times likelier under the
anchor than under the sampler (all its tokens rejected, high side), so the veto, token rejection,
IS truncation, PPO and dual clipping, the KL and the entropy terms are all active, and two rows keep
no token (they stay in the release's loss denominator).

The batch was "sampled" at temperature ``TEMPERATURE`` and rows ``TRUNCATED_ROWS`` with a top-k/top-p
truncation: each of their response positions has a support (the label and 4-30 other ids) over which
every pass renormalises.
"""
import torch

N, WIDTH, GROUP = 8, 14, 4
# (loss_agg_mode, loss_denominator): the release's two (per-sample mean, per-token) and the other
# denominator; each is named "mode/denominator" in the results
LOSSES = (("seq-mean-token-mean", "batch"), ("token-mean", "batch"), ("seq-mean-token-sum", "kept"))
LOSS_NAMES = tuple(f"{mode}/{denominator}" for mode, denominator in LOSSES)
ALGORITHM = {"dual_clip": 3.0, "kl_coef": 0.05, "kl_estimator": "low_var_kl", "entropy_coef": 0.01}
VETOED_ROW, REJECTED_ROW = 1, 6
TEMPERATURE = 0.7
TRUNCATED_ROWS = (0, 1, 2, 3)


def _synthetic(vocab: int):
    """The batch and its supports as ``{(row, label position): [ids]}``."""
    from sparse_rl_mega.batch import RolloutBatch

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (N, WIDTH + 1), generator=g)
    mask = torch.zeros(N, WIDTH)
    for i in range(N):
        start = 2 + i % 4           # label position of the first response token
        end = WIDTH - (i * 3) % 5   # right padding of varying length
        mask[i, start:end] = 1.0
    rewards = torch.randint(0, 2, (N,), generator=g).float()
    supports = {}
    for i in TRUNCATED_ROWS:
        for t in mask[i].nonzero().flatten().tolist():
            others = torch.randperm(vocab, generator=g)[:4 + (i * 7 + t * 3) % 27]
            supports[(i, t)] = [int(ids[i, t + 1])] + [int(v) for v in others if v != ids[i, t + 1]]
    counts = torch.zeros(N, WIDTH, dtype=torch.int32)
    for (i, t), kept in supports.items():
        counts[i, t] = len(kept)
    rows = [torch.tensor([v for t in range(WIDTH) for v in supports.get((i, t), [])], dtype=torch.int32)
            for i in range(N)]
    batch = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=mask,
                         logp_sparse=torch.zeros(N, WIDTH), rewards=rewards, group_ids=torch.arange(N) // GROUP,
                         temperature=TEMPERATURE, support_counts=counts, support_ids=rows)
    return batch, supports


def synthetic_batch(vocab: int):
    return _synthetic(vocab)[0]


def sampled_distribution_logits(logits: torch.Tensor, batch) -> torch.Tensor:
    """``logits [N, WIDTH, V]`` as the sampler's distribution has them: divided by the temperature, and
    -inf outside each truncated position's support (from the supports as drawn, not from the batch's
    packed form)."""
    scaled = logits / batch.temperature
    outside = torch.zeros_like(scaled, dtype=torch.bool)
    for (i, t), kept in _synthetic(logits.shape[-1])[1].items():
        outside[i, t] = True
        outside[i, t, kept] = False
    return scaled.masked_fill(outside, float("-inf"))


def fill_loss_inputs(local, dense: torch.Tensor, rows: torch.Tensor, full_rewards: torch.Tensor, group=None):
    """Set anchor, sampler and reference logprobs, advantages, IS weights and loss mask of ``local``
    (rows ``rows`` of the global batch) from its dense logprobs ``dense [len(rows), WIDTH]``; returns the
    correction's metrics (global over ``group``)."""
    from sparse_rl_mega.algo.advantages import grpo_advantages
    from sparse_rl_mega.algo.correction import compute_correction

    dtype = dense.dtype
    g = torch.Generator().manual_seed(99)
    noise = [torch.randn(N, WIDTH, generator=g, dtype=torch.float64)[rows].to(dtype) for _ in range(3)]
    local.logp_old = dense + 0.3 * noise[0]      # the anchor: the policy has moved since
    local.logp_old[rows == VETOED_ROW, 5] -= 12.0  # a token the anchor finds ~impossible: vetoed
    local.logp_sparse = dense + 0.4 * noise[1]   # the sparse sampler disagrees
    local.logp_sparse[rows == REJECTED_ROW] = local.logp_old[rows == REJECTED_ROW] - 1.0  # rho = e > 1.5
    local.logp_ref = dense - 0.2 * noise[2]
    local.advantages = grpo_advantages(full_rewards, GROUP)[rows].to(dtype)
    local.response_mask = local.response_mask.to(dtype)
    local.is_weights, local.loss_mask, metrics = compute_correction(
        local.logp_old, local.logp_sparse, local.response_mask, "sparse_rl", group=group)
    return metrics
