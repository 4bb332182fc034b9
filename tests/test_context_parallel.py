"""Context-parallel bookkeeping (pure functions): which positions a CP rank holds, splitting and
merging sequences, and the loss aggregation over a sequence split between ranks. The end-to-end proof
(gradients of the real learner at CP2 equal the single-process ones in float64) is in
test_layout_invariance.py; a CP2 training run resumed from a checkpoint in test_resume.py."""
import pytest
import torch

from sparse_rl_mega.algo.loss import aggregate
from sparse_rl_mega.learner.context_parallel import (_sequence_order, cp_positions, merge_sequence, padded_width,
                                                     split_sequence)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ranks_hold_balanced_causal_halves(cp):
    width = 2 * cp * 5
    chunks = torch.arange(width).view(2 * cp, 5)  # chunk k = positions 5k .. 5k+4
    held = [cp_positions(width, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(width))  # a partition of the sequence
    for r, positions in enumerate(held):
        if cp > 1:  # chunk r and its mirror 2cp-1-r: equal causal work (sum of positions) on every rank
            assert positions.tolist() == chunks[r].tolist() + chunks[2 * cp - 1 - r].tolist()
        assert int(positions.sum()) == int(held[0].sum())


def test_split_merge_round_trip_and_gather_order():
    x = torch.randn(3, 16, 2)
    parts = [split_sequence(x, 4, r, dim=1) for r in range(4)]
    assert all(p.shape == (3, 4, 2) for p in parts)
    assert torch.equal(merge_sequence(parts, dim=1), x)
    gathered = torch.cat(parts, dim=1)  # rank after rank, as an all-gather returns them
    assert torch.equal(gathered.index_select(1, _sequence_order(16, 4)), x)


def test_padded_width():
    assert [padded_width(w, 4) for w in (1, 4, 5, 14)] == [4, 4, 8, 16]
    assert padded_width(13, 1) == 13
    with pytest.raises(ValueError, match="not a multiple"):
        cp_positions(14, 2, 0)


@pytest.mark.parametrize("denominator", ["batch", "kept"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_parts_of_split_sequences_sum_to_the_whole(mode, denominator):
    g = torch.Generator().manual_seed(0)
    token_loss = torch.randn(5, 12, generator=g, dtype=torch.float64)
    response = torch.ones(5, 12, dtype=torch.float64)
    response[1, 9:] = 0.0  # padding
    mask = (torch.rand(5, 12, generator=g) > 0.4).double() * response
    mask[2] = 0.0  # a sequence with nothing kept: counted by the batch denominator only
    response_tokens = response.sum(dim=1)
    whole_sum, whole_count = aggregate(token_loss, mask, mode, denominator, response_tokens)
    cp = 3
    seq_tokens = mask.sum(dim=1)
    parts = [aggregate(split_sequence(token_loss, cp, r), split_sequence(mask, cp, r), mode, denominator,
                       response_tokens, seq_tokens=seq_tokens, count_sequences=r == 0) for r in range(cp)]
    assert sum(float(s) for s, _ in parts) == pytest.approx(float(whole_sum), abs=1e-12)
    assert sum(float(c) for _, c in parts) == float(whole_count)
    if mode != "token-mean" or denominator == "batch":  # without one counting rank the counts would not add up
        naive = [aggregate(split_sequence(token_loss, cp, r), split_sequence(mask, cp, r), mode, denominator,
                           response_tokens, seq_tokens=seq_tokens) for r in range(cp)]
        assert sum(float(c) for _, c in naive) != float(whole_count)
