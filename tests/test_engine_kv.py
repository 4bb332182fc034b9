"""The real SGLang engine with the sparse-rl-mega patch, against a pure-torch reference decoder.

One engine (StreamingLLM, budget 12, sink 2, compress at 14) serves every test in this module; SGLang's
strict idle memory check is on, so a leaked or double-freed KV slot crashes the engine.
"""
import time

import torch

from sparse_rl_mega.kv import build_policy
from sparse_rl_mega.kv.reference_decoder import ReferenceDecoder
from tests.conftest import ENGINE_KV

TOL = 1e-4


def _policy():
    return build_policy(ENGINE_KV["policy"], sink=ENGINE_KV["sink"], window=ENGINE_KV["window"])


def _check_samples(samples, hf_model):
    ref = ReferenceDecoder(hf_model)
    evicted_total = 0
    for s in samples:
        evicted_logp, evicted = ref.logprobs(s.prompt_ids, s.response_ids, _policy(), ENGINE_KV["budget"],
                                             ENGINE_KV["interval"])
        dense_logp, _ = ref.logprobs(s.prompt_ids, s.response_ids)
        gap_to_evicted = max(abs(a - b) for a, b in zip(evicted_logp, s.logp_sparse))
        assert gap_to_evicted < TOL, (gap_to_evicted, s)
        if evicted:
            # eviction changed the sampler: the dense policy disagrees somewhere
            assert max(abs(a - b) for a, b in zip(dense_logp, s.logp_sparse)) > 1e-3
        evicted_total += evicted
    return evicted_total


def test_single_request_matches_reference_with_eviction(evicting_engine, hf_model):
    prompt = [5, 17, 42, 99, 100, 7, 8, 9, 11, 12]
    samples = evicting_engine.generate([prompt], n_samples=1, max_new_tokens=24, temperature=1.0, seed=11)
    # the first response token comes from prefill, never compressed: exact against full attention
    assert _check_samples(samples, hf_model) > 0, "budget below the sequence length must evict"


def test_group_sharing_a_cached_prompt_matches_reference(evicting_engine, hf_model):
    prompt = list(range(30, 50))  # 20 tokens: longer than the budget, so shared tree slots are evicted too
    before = evicting_engine.kv_stats()
    samples = evicting_engine.generate([prompt, prompt[:9]], n_samples=3, max_new_tokens=20, seed=5)
    after = evicting_engine.kv_stats()
    assert len(samples) == 6 and [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert _check_samples(samples, hf_model) > 0
    assert after["dropped_shared_slots"] > before["dropped_shared_slots"]  # the shared prompt was skipped, not freed
    assert after["compactions"] > before["compactions"]


def test_engine_frees_evicted_slots_and_survives_idle_leak_check(evicting_engine):
    before = evicting_engine.kv_stats()
    evicting_engine.generate([[3, 4, 5, 6, 7]], n_samples=4, max_new_tokens=40, seed=2)
    after = evicting_engine.kv_stats()
    assert after["freed_slots"] > before["freed_slots"]
    # a compressed row holds at most budget + interval slots: peak < what dense decoding needs
    dense_need = 4 * (5 + 40)
    assert after["peak_slots_in_use"] < dense_need
    time.sleep(1.5)  # scheduler idles -> SGLang's strict KV leak check runs
    assert len(evicting_engine.generate([[1, 2, 3]], n_samples=2, max_new_tokens=2)) == 2


def test_dense_prefill_logprobs_equal_hf(evicting_engine, hf_model):
    ids = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # longer than the budget
    engine_logp = evicting_engine.dense_logprobs(ids)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    hf_logp = [float(logits[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(engine_logp, hf_logp)) < TOL
