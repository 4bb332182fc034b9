"""Eviction policies against independent loop implementations of their published formulas."""
import math

import pytest
import torch

from sparse_rl_mega.kv import POLICIES, build_policy, should_compress
from sparse_rl_mega.kv.policies import decode_attention_mass, window_attention_mass

KV_HEADS, Q_HEADS, LENGTH, WINDOW, DIM = 2, 4, 23, 4, 8


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV_HEADS, LENGTH, DIM, generator=g, dtype=torch.float64)
    keys[:, 15] = keys[:, 9] * 1.01  # a near-duplicate pair for R-KV's redundancy
    queries = torch.randn(Q_HEADS, WINDOW, DIM, generator=g, dtype=torch.float64)
    return keys, queries


def _window_probs(keys, queries):
    """probs[h][i][j]: softmax over visible keys of query i (cache position LENGTH - WINDOW + i)."""
    group = Q_HEADS // KV_HEADS
    out = [[[0.0] * LENGTH for _ in range(WINDOW)] for _ in range(Q_HEADS)]
    for h in range(Q_HEADS):
        for i in range(WINDOW):
            visible = LENGTH - WINDOW + i + 1
            logits = [float(queries[h, i] @ keys[h // group, j]) / math.sqrt(DIM) for j in range(visible)]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            for j in range(visible):
                out[h][i][j] = exps[j] / sum(exps)
    return out


def _pool(row, kernel, mode):
    half = kernel // 2
    res = []
    for j in range(len(row)):
        part = row[max(0, j - half):j + half + 1]
        res.append(max(part) if mode == "max" else sum(part) / len(part))
    return res


def test_snapkv_score_is_pooled_window_attention():
    keys, queries = _tensors()
    policy = POLICIES["snapkv"](sink=2, window=WINDOW, kernel=5, pool="avg")
    probs = _window_probs(keys, queries)
    group = Q_HEADS // KV_HEADS
    for kv in range(KV_HEADS):
        raw = [sum(probs[h][i][j] for h in range(kv * group, (kv + 1) * group) for i in range(WINDOW))
               / (group * WINDOW) for j in range(LENGTH)]
        expected = _pool(raw, 5, "avg")
        assert torch.allclose(policy.score(keys, queries)[kv].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def test_rkv_score_is_importance_minus_redundancy():
    keys, queries = _tensors(1)
    lam, tau = 0.3, 0.5
    policy = POLICIES["rkv"](sink=0, window=WINDOW, lam=lam, kernel=3, similarity_threshold=tau)
    probs = _window_probs(keys, queries)
    group = Q_HEADS // KV_HEADS
    for kv in range(KV_HEADS):
        mean_per_head = [[sum(probs[h][i][j] for i in range(WINDOW)) / WINDOW for j in range(LENGTH)]
                         for h in range(kv * group, (kv + 1) * group)]
        importance = _pool([max(col) for col in zip(*mean_per_head)], 3, "max")
        unit = [keys[kv, j] / keys[kv, j].norm() for j in range(LENGTH)]
        sim = [[0.0 if a == b else float(unit[a] @ unit[b]) for b in range(LENGTH)] for a in range(LENGTH)]
        mean_sim = []
        for a in range(LENGTH):
            has_later_duplicate = any(sim[a][b] > tau for b in range(a + 1, LENGTH))
            mean_sim.append(sum(sim[a]) / (LENGTH - 1) if has_later_duplicate else 0.0)
        top = max(mean_sim)
        exps = [math.exp(x - top) for x in mean_sim]
        redundancy = [e / sum(exps) for e in exps]
        expected = [lam * i - (1 - lam) * r for i, r in zip(importance, redundancy)]
        assert torch.allclose(policy.score(keys, queries)[kv].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def test_rkv_penalises_the_older_of_near_duplicates():
    keys = torch.eye(6, dtype=torch.float64).unsqueeze(0)  # orthogonal keys ...
    keys[0, 4] = keys[0, 1]                                 # ... but key 4 repeats key 1
    redundancy = POLICIES["rkv"](sink=0, window=2).redundancy(keys)[0]
    assert redundancy[1] > redundancy[4]  # the older copy is redundant, the most recent one protected
    assert torch.allclose(redundancy[[0, 2, 3, 4, 5]], redundancy[0].expand(5))


@pytest.mark.parametrize("per_head", [False, True])
def test_selection_keeps_sink_window_and_top_scores(per_head):
    keys, queries = _tensors(2)
    budget = 12
    policy = POLICIES["snapkv"](sink=2, window=WINDOW, kernel=1, per_head=per_head)
    kept = policy.select(keys, queries, budget)
    scores = policy.score(keys, queries)
    if not per_head:
        scores = scores.sum(dim=0, keepdim=True)
        kept = kept.unsqueeze(0)
    for row, head_scores in zip(kept, scores):
        chosen = set(row.tolist())
        assert len(chosen) == budget and row.tolist() == sorted(row.tolist())
        assert {0, 1} | set(range(LENGTH - WINDOW, LENGTH)) <= chosen
        middle = [j for j in range(2, LENGTH - WINDOW)]
        ranked = sorted(middle, key=lambda j: -float(head_scores[j]))
        assert set(ranked[:budget - 2 - WINDOW]) == chosen - {0, 1} - set(range(LENGTH - WINDOW, LENGTH))


def test_h2o_ranks_by_accumulated_attention():
    keys, _ = _tensors(3)
    accumulated = torch.zeros(KV_HEADS, LENGTH)
    accumulated[:, [5, 7, 11]] = torch.tensor([3.0, 2.0, 1.0])
    kept = POLICIES["h2o"](sink=1, window=2).select(keys, None, budget=6, accumulated=accumulated)
    assert kept.tolist() == [0, 5, 7, 11, LENGTH - 2, LENGTH - 1]


def test_decode_attention_mass_sums_group_probabilities():
    keys, queries = _tensors(4)
    mass = decode_attention_mass(keys, queries[:, 0], DIM ** -0.5)
    assert mass.shape == (KV_HEADS, LENGTH)
    assert torch.allclose(mass.sum(dim=1), torch.full((KV_HEADS,), float(Q_HEADS // KV_HEADS)), atol=1e-5)


def test_window_attention_mass_equals_step_by_step_mass():
    """The engine adds H2O's mass for several decode steps at once; the reference adds it per step."""
    g = torch.Generator().manual_seed(5)
    window, lengths, counts = 4, [9, 12], [4, 2]
    keys = torch.randn(2, KV_HEADS, 14, DIM, generator=g)  # padded past each length with junk
    queries = torch.randn(2, Q_HEADS, window, DIM, generator=g)
    batched = window_attention_mass(keys, queries, 0.3, torch.tensor(lengths), torch.tensor(counts))
    for r, (length, count) in enumerate(zip(lengths, counts)):
        expected = torch.zeros(KV_HEADS, 14)
        for i in range(window - count, window):  # query i was decoded with keys [0, position]
            position = length - window + i
            expected[:, :position + 1] += decode_attention_mass(keys[r, :, :position + 1], queries[r, :, i], 0.3)
        assert torch.allclose(batched[r], expected, atol=1e-6), r
    assert batched[1, :, 12:].abs().max() == 0  # keys past a length get nothing


def test_streaming_keeps_sinks_and_recent():
    policy = POLICIES["streaming"](sink=2, window=4)
    assert policy.select(None, None, budget=8, length=20).tolist() == [0, 1, 14, 15, 16, 17, 18, 19]
    assert policy.select(None, None, budget=8, length=6).tolist() == list(range(6))
    with pytest.raises(ValueError, match="must exceed sink"):
        policy.select(None, None, budget=6, length=20)


def test_compression_trigger_waits_for_queries():
    assert not should_compress(13, budget=12, interval=2)
    assert should_compress(14, budget=12, interval=2)
    assert not should_compress(14, 12, 2, decode_queries=3, queries_needed=4)
    assert should_compress(14, 12, 2, decode_queries=4, queries_needed=4)
    assert build_policy("rkv", sink=0, window=8).min_decode_queries == 8
    assert build_policy("h2o", sink=0, window=8).min_decode_queries == 0


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="kernel"):
        build_policy("snapkv", sink=0, window=4, kernel=4)
    with pytest.raises(KeyError, match="unknown KV eviction policy"):
        build_policy("magic", sink=0, window=4)


def test_newline_tokens_come_from_the_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    from sparse_rl_mega.config import KVCompressionConfig
    from sparse_rl_mega.rollout.engine import engine_kv_settings

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = engine_kv_settings(KVCompressionConfig(policy="rkv", trigger="newline"), tokenizer)
    assert tokenizer("\n")["input_ids"][-1] in settings.newline_token_ids
    assert all(tokenizer.decode([t]).endswith("\n") for t in settings.newline_token_ids)
    assert engine_kv_settings(KVCompressionConfig(policy="rkv")).newline_token_ids == []
    with pytest.raises(ValueError, match="needs the tokenizer"):
        engine_kv_settings(KVCompressionConfig(policy="rkv", trigger="newline"))
