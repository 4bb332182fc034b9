"""The engine tests' KV policy cases and their check against the pure-torch reference decoder (shared by
tests/test_engine_kv.py, torch_native, and tests/test_engine_triton.py, triton under Triton's interpreter)."""
from sparse_rl_mega.kv import build_policy
from sparse_rl_mega.kv.reference_decoder import ReferenceDecoder
from tests.conftest import ENGINE_KV

# The engine (SGLang's torch_native attention, float32) against the reference decoder (transformers, float32):
# two float32 forward passes of the tiny model. Their worst-case rounding bound (2 x gamma_n x max|logit|,
# n ~ 1.9e3 reductions: ~7e-3; tests/helpers/float_bounds.py) is looser than the eviction effects these
# tests must see (a kept set changes logprobs by > 1e-3), so this bound is the other kind: >= 10x the
# largest spread measured across kernels (ATEN_CPU_CAPABILITY default / avx2, 1 and 2 threads, and MKL's
# instruction sets; docs/testing.md), and 10x below the smallest eviction effect checked.
TOL = 1e-4
POLICY_CASES = {
    "streaming": {"policy": "streaming"},
    "snapkv": {"policy": "snapkv", "params": {"kernel": 3, "pool": "max"}},
    "snapkv-per-head": {"policy": "snapkv", "selection": "per_head", "params": {"kernel": 3, "pool": "avg",
                                                                                "gqa_pool": "mean"}},
    "rkv": {"policy": "rkv", "params": {"kernel": 3, "lam": 0.1, "similarity_threshold": 0.5}},
    "rkv-per-head": {"policy": "rkv", "selection": "per_head",
                     "params": {"kernel": 3, "lam": 0.5, "similarity_threshold": 0.3}},
    # the paper's release: one set per request for every layer, from the first layer's scores (no K/V copies)
    "rkv-shared": {"policy": "rkv", "selection": "shared", "sink": 0},
    "snapkv-shared-layer-sum": {"policy": "snapkv", "selection": "shared", "shared_scores": "layer_sum"},
    # requests reaching the trigger together scored one at a time (a 1-byte scoring workspace)
    "rkv-chunked": {"policy": "rkv", "scoring_workspace_bytes": 1},
    "rkv-shared-chunked": {"policy": "rkv", "selection": "shared", "scoring_workspace_bytes": 1},
    "h2o": {"policy": "h2o"},
    "h2o-per-head": {"policy": "h2o", "selection": "per_head"},
    "h2o-shared": {"policy": "h2o", "selection": "shared"},
    # interval > window: the engine adds H2O's attention mass when its query ring fills, between compressions
    "h2o-interval-7": {"policy": "h2o", "interval": 7},
    # a policy of another package (tests/plugins), registered by its entry point in the scheduler too
    "keynorm": {"policy": "keynorm", "params": {"power": 1}},
}


def policy_of(case: dict):
    """The reference decoder's policy object for a request's KV override ``case``."""
    return build_policy(case["policy"], sink=case.get("sink", ENGINE_KV["sink"]), window=ENGINE_KV["window"],
                        selection=case.get("selection", "per_layer"),
                        shared_scores=case.get("shared_scores", "first_layer"), **case.get("params", {}))


def check_samples(samples, hf_model, case: dict, record_property) -> int:
    """Each sample's sampler logprobs against the reference decoder with the same eviction (within
    ``TOL``), and, where eviction happened, unlike the dense ones; returns the evicted tokens."""
    ref = ReferenceDecoder(hf_model)
    evicted_total = 0
    for s in samples:
        evicted_logp, evicted = ref.logprobs(s.prompt_ids, s.response_ids, policy_of(case), ENGINE_KV["budget"],
                                             case.get("interval", ENGINE_KV["interval"]))
        assert len(evicted_logp) == len(s.logp_sparse)
        gap = max(abs(a - b) for a, b in zip(evicted_logp, s.logp_sparse))
        record_property("max_abs_logprob_gap", gap)  # (--junitxml: the spread across CPUs, docs/testing.md)
        assert gap < TOL, (case, gap)
        if evicted:  # eviction changed the sampler: the dense policy disagrees somewhere
            dense_logp, _ = ref.logprobs(s.prompt_ids, s.response_ids)
            effect = max(abs(a - b) for a, b in zip(dense_logp, s.logp_sparse))
            record_property("eviction_effect", effect)
            assert effect > 10 * TOL
        evicted_total += evicted
    return evicted_total
