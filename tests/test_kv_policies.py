"""Eviction policies against independent loop implementations of their published formulas.

The policies score in float32 (the engine's buffers); the loops compute in float64. Each comparison's
bound is that of the float32 computation (tests/helpers/float_bounds.py: softmax_error for each
probability, gamma_n for every further sum or mean), from the very inputs, not from one CPU's result;
the alternatives each test tells apart are >= 1e-2 away."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
from float_bounds import U32, gamma, logit_mass, softmax_error

from sparse_rl_mega.kv import POLICIES, build_policy, should_compress
from sparse_rl_mega.kv.attention_mass import decode_attention_mass, window_attention_mass
from sparse_rl_mega.kv.scoring import key_redundancy

KV_HEADS, Q_HEADS, LENGTH, WINDOW, DIM = 2, 4, 23, 4, 8


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV_HEADS, LENGTH, DIM, generator=g, dtype=torch.float64)
    keys[:, 15] = keys[:, 9] * 1.01  # a near-duplicate pair for R-KV's redundancy
    queries = torch.randn(Q_HEADS, WINDOW, DIM, generator=g, dtype=torch.float64)
    return keys, queries


# ---------------------------------------------------------------------------------------------
# The published scoring, written again from a reading of the authors' code (the paper's release,
# sglang-kvc/python/sglang/compress/r1kv_utils.py: compute_attention_scores, cal_similarity,
# KVCluster.get_compress_indices with attn_pooling="max", pooling="maxpool", mix_alpha=0.1 as built
# in srt/managers/tp_worker.py; R-KV's rkv/utils.py and rkv/compression/r1_kv.py, snapkv.py), one
# head, one query and one key at a time. It shares no code with sparse_rl_mega.kv (base.py, scoring.py, the policies).


def _softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def published_importance(keys, queries, kv_head, gqa_pool="max", kernel=7, pool="max"):
    """The window's attention to the keys before it: logits of every query head of the group, pooled
    over the group (max or mean) before the softmax; softmax over the keys before the window; mean over
    the window's queries; pooled along the sequence with kernel // 2 zero padding at both ends."""
    q_heads, window, dim = queries.shape
    kv_heads, length, _ = keys.shape
    group, older = q_heads // kv_heads, length - window
    mean_probs = [0.0] * older
    for i in range(window):
        # logits[g][j]: query head g of the group against key j, one key vector at a time
        logits = [(keys[kv_head, :older].double() @ queries[kv_head * group + g, i].double() / math.sqrt(dim)).tolist()
                  for g in range(group)]
        pooled = [max(col) if gqa_pool == "max" else sum(col) / group for col in zip(*logits, strict=True)]
        for j, p in enumerate(_softmax(pooled)):
            mean_probs[j] += p / window
    half, out = kernel // 2, []
    for j in range(older):
        part = [mean_probs[t] for t in range(j - half, j + half + 1) if 0 <= t < older]
        out.append(max(part) if pool == "max" else sum(part) / kernel)  # avg_pool1d counts the padding
    return out


def published_redundancy(keys, kv_head, threshold=0.5):
    """cal_similarity: cosine similarities (k / (|k| + 1e-8)), diagonal 0; in row i zero the entry of
    the last j with similarity > threshold (j = 0 when none); mean of each column over the rows; softmax."""
    k = keys[kv_head].double()
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    length = k.shape[0]
    sim = (unit @ unit.T).tolist()
    for i in range(length):
        sim[i][i] = 0.0
    for i in range(length):
        above = [j for j in range(length) if sim[i][j] > threshold]
        sim[i][max(above) if above else 0] = 0.0
    return _softmax([sum(sim[i][j] for i in range(length)) / length for j in range(length)])


def published_score(name, keys, queries, kv_head, lam=0.1, **importance):
    imp = published_importance(keys, queries, kv_head, **importance)
    if name == "snapkv":
        return imp
    red = published_redundancy(keys, kv_head)[:len(imp)]  # redundancy of all keys, sliced to the scored ones
    return [lam * a - (1 - lam) * r for a, r in zip(imp, red, strict=True)]


def published_kept(name, layer_keys, layer_queries, budget, selection, shared_scores="first_layer", sink=0,
                   lam=0.1, **importance):
    """Kept positions: the window + the top (budget - sink - window) older keys by score (ties: older
    first) + ``sink`` first tokens. Per head: each head its own; per layer: summed over heads; shared:
    the first layer's summed scores (the release) or every layer's (layer_sum), one set for all layers."""
    layers = len(layer_keys)
    kv_heads, length, _ = layer_keys[0].shape
    window = layer_queries[0].shape[1]
    scores = [[published_score(name, layer_keys[layer], layer_queries[layer], h, lam, **importance)
               for h in range(kv_heads)] for layer in range(layers)]

    def top(values):
        ranked = sorted(range(sink, length - window), key=lambda j: (-values[j], j))
        return sorted(list(range(sink)) + ranked[:budget - sink - window] + list(range(length - window, length)))

    if selection == "per_head":
        return [[top(scores[layer][h]) for h in range(kv_heads)] for layer in range(layers)]
    per_layer = [[sum(scores[layer][h][j] for h in range(kv_heads)) for j in range(length - window)] for layer in range(layers)]
    if selection == "per_layer":
        return [top(v) for v in per_layer]
    used = 1 if shared_scores == "first_layer" else layers
    return top([sum(per_layer[layer][j] for layer in range(used)) for j in range(length - window)])


def _published_inputs(seed, duplicates, layers=2, kv_heads=2, q_heads=8, length=96, dim=32, window=8):
    """Random float32 keys and queries; ``duplicates``: most keys are noisy copies of a few directions."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, kv_heads, length, dim, generator=g)
    if duplicates:
        bases = torch.randn(layers, kv_heads, 6, dim, generator=g)
        pick = torch.randint(0, 6, (length,), generator=g)
        keys = bases[:, :, pick] * (1 + torch.rand(layers, kv_heads, length, 1, generator=g)) \
            + 0.05 * keys
    queries = torch.randn(layers, q_heads, window, dim, generator=g) * 2
    return keys, queries


@pytest.mark.parametrize("name", ["snapkv", "rkv"])
@pytest.mark.parametrize("selection", ["per_layer", "per_head", "shared", "shared-layer_sum"])
@pytest.mark.parametrize("duplicates", [False, True])
def test_policies_keep_what_the_published_code_keeps(name, selection, duplicates):
    keys, queries = _published_inputs(seed=7 + duplicates, duplicates=duplicates)
    selection, _, shared_scores = selection.partition("-")
    shared_scores = shared_scores or "first_layer"
    budget = 64
    policy = build_policy(name, sink=0, window=8, selection=selection, shared_scores=shared_scores)
    kept = policy.select_layers(keys[None], queries[None], budget)[0].tolist()
    assert kept == published_kept(name, keys, queries, budget, selection, shared_scores)


def test_the_issue_shapes_agree_with_the_published_code():
    """The shapes of the issue that found the gaps: 2 KV heads, 16 query heads, head_dim 128, 640 tokens,
    budget 512, window 8, a share of near-duplicate keys; float32, release settings (shared from layer 0)."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 640, 128, generator=g)
    keys[0, :, 100:300:2] = keys[0, :, 101:301:2] * 1.02 + 0.01 * torch.randn(1, 2, 100, 128, generator=g)
    queries = torch.randn(1, 16, 8, 128, generator=g)
    for name in ("rkv", "snapkv"):
        for selection in ("shared", "per_head"):
            policy = build_policy(name, sink=0, window=8, selection=selection)
            expected = published_kept(name, [keys[0]], [queries[0]], 512, selection)
            kept = policy.select_layers(keys[None], queries[None], 512)[0].tolist()
            assert kept == expected, (name, selection)


@pytest.mark.parametrize("gqa_pool, pool", [("mean", "avg"), ("max", "avg"), ("mean", "max")])
def test_importance_options_follow_the_published_options(gqa_pool, pool):
    keys, queries = _published_inputs(seed=2, duplicates=False, layers=1, length=40)
    policy = build_policy("snapkv", sink=0, window=8, selection="per_head", kernel=5, gqa_pool=gqa_pool, pool=pool)
    scores = policy.score(keys[0], queries[0])
    dim, window, older = keys.shape[-1], 8, keys.shape[-2] - 8
    group = queries.shape[1] // keys.shape[1]
    # a probability's error, then the group mean of logits (its mass grows by nothing), the window mean
    # and the pooling (sums of <= group, window, kernel terms of values <= 1)
    bound = softmax_error(dim, logit_mass(keys[0], queries[0], dim ** -0.5), older) + gamma(group + window + 5, U32)
    for h in range(keys.shape[1]):
        expected = published_importance(keys[0], queries[0], h, gqa_pool=gqa_pool, kernel=5, pool=pool)
        assert torch.allclose(scores[h].double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=bound)


def test_rkv_redundancy_penalises_the_older_of_near_duplicates():
    keys = torch.eye(6, dtype=torch.float64).unsqueeze(0)  # orthogonal keys ...
    keys[0, 3] = keys[0, 4] = keys[0, 1]                    # ... but keys 3 and 4 repeat key 1
    redundancy = key_redundancy(keys, 0.5)[0]
    # each copy's row zeroes its entry to its last copy: column 1 keeps two entries, column 3 one
    # (row 1's), column 4 none (the most recent copy is protected)
    assert redundancy[1] > redundancy[3] > redundancy[4] and torch.isclose(redundancy[4], redundancy[2])
    # cosine similarities of unit keys (6 terms, mass <= 1), a column mean (6 terms), a softmax over 6 keys
    bound = softmax_error(6 + 6, 1.0, 6)
    assert torch.allclose(redundancy.double(), torch.tensor(published_redundancy(keys, 0), dtype=torch.float64),
                          rtol=0, atol=bound)


def test_selection_keeps_sink_window_and_top_scores():
    keys, queries = _tensors(2)
    budget = 12
    policy = POLICIES["snapkv"](sink=2, window=WINDOW, kernel=1, selection="per_head")
    kept = policy.select(keys, queries, budget)
    scores = policy.score(keys, queries)
    assert scores.shape == (KV_HEADS, LENGTH - WINDOW)
    assert kept.shape == (KV_HEADS, budget)
    for row, head_scores in zip(kept, scores, strict=True):
        chosen = set(row.tolist())
        assert len(chosen) == budget and row.tolist() == sorted(row.tolist())
        assert {0, 1} | set(range(LENGTH - WINDOW, LENGTH)) <= chosen
        ranked = sorted(range(2, LENGTH - WINDOW), key=lambda j: -float(head_scores[j]))
        assert set(ranked[:budget - 2 - WINDOW]) == chosen - {0, 1} - set(range(LENGTH - WINDOW, LENGTH))


def test_gathered_heads_decide_per_layer_and_shared_choices():
    """An engine rank at TP 2 holds one of the two KV heads: with every head's scores gathered it keeps
    what the whole layer keeps; from its own head alone it would keep something else."""
    keys, queries = _published_inputs(seed=4, duplicates=False, layers=1, kv_heads=2, q_heads=4, length=60)
    for selection in ("per_layer", "shared"):
        policy = build_policy("rkv", sink=0, window=8, selection=selection)
        whole = policy.select_layers(keys[None], queries[None], 30)
        other = policy.score(keys[0, 1:], queries[0, 2:]).view(1, 1, 1, -1)
        rank0 = policy.select_layers(keys[None, :, :1], queries[None, :, :2], 30,
                                     gather_heads=lambda s: torch.cat([s, other], dim=2))  # noqa: B023 (called now)
        alone = policy.select_layers(keys[None, :, :1], queries[None, :, :2], 30)
        assert torch.equal(rank0, whole)
        assert not torch.equal(alone, whole)


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
    group = Q_HEADS // KV_HEADS
    # each head's probabilities sum to 1 within their normaliser's and the final sum's rounding (2 gamma_L
    # + 2u), summed over the group (+ gamma_group), then summed again over the keys here (gamma_L)
    bound = group * (2 * gamma(LENGTH, U32) + 2 * U32) + (gamma(group, U32) + gamma(LENGTH, U32)) * group
    assert torch.allclose(mass.sum(dim=1), torch.full((KV_HEADS,), float(group)), rtol=0, atol=bound)


def mass_bound(keys, query, scaling, length: int) -> float:
    """Error bound of one entry of a float32 attention mass: the group's probabilities summed."""
    group = query.shape[-2] // keys.shape[-3]
    one = softmax_error(keys.shape[-1], logit_mass(keys, query, scaling), length)
    return group * one + gamma(group, U32) * group


def reference_attention_mass(keys, query, scaling, length=None, kv_of=None):
    """H2O's mass of one decode query, one query head at a time: query head ``h`` attends with KV head
    ``h // (q_heads // kv_heads)`` (consecutive query heads share a KV head, as transformers' ``repeat_kv``
    and SGLang's GQA kernels); ``softmax_j(scaling * q_h . k_j)`` over the keys ``j < length``, added to
    that KV head's row. ``kv_of`` swaps in another head grouping (to show the test can tell them apart)."""
    kv_heads, width, _ = keys.shape
    q_heads = query.shape[0]
    group = q_heads // kv_heads
    length = width if length is None else length
    kv_of = kv_of or (lambda h: h // group)
    mass = [[0.0] * width for _ in range(kv_heads)]
    for h in range(q_heads):
        kv = kv_of(h)
        logits = [scaling * float(keys[kv, j].double() @ query[h].double()) for j in range(length)]
        for j, p in enumerate(_softmax(logits)):
            mass[kv][j] += p
    return torch.tensor(mass, dtype=torch.float64)


def test_reference_grouping_is_repeat_kv():
    """The reference's grouping is the one of transformers' attention: repeat_kv gives query head h the
    KV head h // group."""
    from transformers.models.llama.modeling_llama import repeat_kv

    keys = torch.arange(3.0).view(1, 3, 1, 1)  # KV head k holds the value k
    expanded = repeat_kv(keys, 4)[0, :, 0, 0]
    assert expanded.tolist() == [h // 4 for h in range(12)]


def test_decode_attention_mass_matches_a_per_head_loop():
    """Not only do the rows add up to the group size: every entry is the loop's, and the inputs are
    such that the other grouping (h % kv_heads) or another scale would give other numbers."""
    g = torch.Generator().manual_seed(6)
    kv_heads, q_heads, length, dim, scaling = 2, 6, 11, 8, 0.7  # scaling is not dim ** -0.5
    keys = torch.randn(kv_heads, length, dim, generator=g, dtype=torch.float64)
    query = torch.randn(q_heads, dim, generator=g, dtype=torch.float64)
    mass = decode_attention_mass(keys, query, scaling)
    expected = reference_attention_mass(keys, query, scaling)
    assert mass.dtype == torch.float32 and mass.shape == (kv_heads, length)
    assert torch.allclose(mass.double(), expected, rtol=0, atol=mass_bound(keys, query, scaling, length))
    # the test tells the convention apart: every alternative is far from the reference
    alternatives = {
        "h % kv_heads": reference_attention_mass(keys, query, scaling, kv_of=lambda h: h % kv_heads),
        "1 / sqrt(head_dim)": reference_attention_mass(keys, query, dim ** -0.5),
        "no scaling": reference_attention_mass(keys, query, 1.0),
    }
    for name, other in alternatives.items():
        assert (other - expected).abs().max() > 1e-2, name


def test_batched_decode_attention_mass_masks_past_each_length():
    """With a batch and ``lengths``: each request's softmax runs over its own keys only; keys past its
    length (junk in the padded cache) get nothing."""
    g = torch.Generator().manual_seed(8)
    kv_heads, q_heads, width, dim, scaling = 2, 4, 10, 8, 0.45
    lengths = [10, 6, 1]
    keys = torch.randn(len(lengths), kv_heads, width, dim, generator=g, dtype=torch.float64) * 2
    query = torch.randn(len(lengths), q_heads, dim, generator=g, dtype=torch.float64)
    mass = decode_attention_mass(keys, query, scaling, lengths=torch.tensor(lengths))
    assert mass.shape == (len(lengths), kv_heads, width)
    for r, length in enumerate(lengths):
        expected = reference_attention_mass(keys[r], query[r], scaling, length=length)
        assert torch.allclose(mass[r].double(), expected, rtol=0, atol=mass_bound(keys[r], query[r], scaling, length)), r
        assert torch.all(mass[r, :, length:] == 0)  # empty for the full-length request
    # unmasked, the short requests would spread mass over the junk keys
    assert not torch.allclose(decode_attention_mass(keys, query, scaling)[1], mass[1], atol=1e-2)


def test_window_attention_mass_equals_step_by_step_mass():
    """The engine adds H2O's mass for several decode steps at once; the reference adds it per step."""
    g = torch.Generator().manual_seed(5)
    window, lengths, counts = 4, [9, 12], [4, 2]
    keys = torch.randn(2, KV_HEADS, 14, DIM, generator=g)  # padded past each length with junk
    queries = torch.randn(2, Q_HEADS, window, DIM, generator=g)
    batched = window_attention_mass(keys, queries, 0.3, torch.tensor(lengths), torch.tensor(counts))
    for r, (length, count) in enumerate(zip(lengths, counts, strict=True)):
        expected = torch.zeros(KV_HEADS, 14)
        for i in range(window - count, window):  # query i was decoded with keys [0, position]
            position = length - window + i
            expected[:, :position + 1] += decode_attention_mass(keys[r, :, :position + 1], queries[r, :, i], 0.3)
        # two float32 computations of a sum over `count` steps of masses: each within the bound of its
        # own, so within twice that of one another (+ the sum over the steps)
        one = mass_bound(keys[r], queries[r], 0.3, 14)
        bound = 2 * (count * one + gamma(count, U32) * count * (Q_HEADS // KV_HEADS))
        assert torch.allclose(batched[r], expected, rtol=0, atol=bound), r
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
    assert build_policy("h2o", sink=0, window=8).min_decode_queries == 8  # its first choice needs some attention
    assert build_policy("streaming", sink=0, window=8).min_decode_queries == 0


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="kernel"):
        build_policy("snapkv", sink=0, window=4, kernel=4)
    with pytest.raises(KeyError, match="unknown KV eviction policy"):
        build_policy("magic", sink=0, window=4)


def test_newline_tokens_come_from_the_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    from sparse_rl_mega.config import KVCompressionConfig
    from sparse_rl_mega.rollout.engine_args import engine_kv_settings

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    settings = engine_kv_settings(KVCompressionConfig(policy="rkv", trigger="newline"), tokenizer)
    assert tokenizer("\n")["input_ids"][-1] in settings.newline_token_ids
    assert all(tokenizer.decode([t]).endswith("\n") for t in settings.newline_token_ids)
    assert engine_kv_settings(KVCompressionConfig(policy="rkv")).newline_token_ids == []
    with pytest.raises(ValueError, match="needs the tokenizer"):
        engine_kv_settings(KVCompressionConfig(policy="rkv", trigger="newline"))


def test_the_registry_refuses_what_would_break_a_config():
    """Names a config can write (an identifier, not 'none'), classes that are policies, one class per
    name; a policy's parameters are its own fields, of their declared types."""
    from sparse_rl_mega.kv.base import PolicyError
    from sparse_rl_mega.kv.rkv import RKVPolicy
    from sparse_rl_mega.kv.registry import register_policy, resolve_params

    with pytest.raises(ValueError, match="expected an identifier other than 'none'"):
        register_policy("none", RKVPolicy)
    with pytest.raises(ValueError, match="expected an identifier"):
        register_policy("rkv:64", RKVPolicy)
    with pytest.raises(TypeError, match="not a subclass of EvictionPolicy"):
        register_policy("mine", dict)
    with pytest.raises(ValueError, match="already registered as SnapKVPolicy"):
        register_policy("snapkv", RKVPolicy)
    register_policy("rkv", RKVPolicy)  # the same class again: nothing changes
    assert resolve_params("snapkv", {"kernel": 5}) == {"kernel": 5, "pool": "max", "gqa_pool": "max"}
    assert resolve_params("rkv", {"lam": 1})["lam"] == 1.0  # an int where a float is declared
    with pytest.raises(PolicyError, match="takes no parameter 'lam'") as info:
        resolve_params("snapkv", {"lam": 0.2})
    assert info.value.key == "params.lam"
    with pytest.raises(PolicyError, match="kernel = True: expected int, got bool"):
        resolve_params("rkv", {"kernel": True})
