"""KV eviction under a GPU attention backend's own code, on this CPU: SGLang's ``triton`` backend, its
kernels run by Triton's interpreter (``TRITON_INTERPRET=1`` in the engine's processes, which are then
spawned: ``rollout/engine_processes.engine_process_env``).

One engine, every request with its own policy (streaming, SnapKV, R-KV, H2O; per layer and shared),
SGLang's strict idle leak check on, and the patch's metadata check (``sglang_patches/metadata_check``):
in every decode step the triton backend's ``kv_indptr`` / ``kv_indices`` (from SGLang's KV-index
kernel) and fa3's ``page_table`` / ``cache_seqlens`` (its metadata code, run on the same batch) must be
each row's kept slots in order, lengths must agree, no index may point at a free slot.

The interpreter runs a kernel's programs one by one (~0.2 s per request and decode step here, one KV
split; the module takes ~55 s), so responses are the shortest that still compress several times:
budget 12, interval 2; 10 tokens after a 10-token prompt, or after a 20-token shared prompt, compress
3 to 5 times (the scoring policies first wait for 4 decode queries).
"""
import time

import pytest

from tests.conftest import ENGINE_KV
from sparse_rl_mega.kv import replay_compression
from tests.helpers.engine_cases import POLICY_CASES, check_samples, policy_of

POLICIES = ["streaming", "snapkv", "snapkv-shared-layer-sum", "rkv", "rkv-shared", "h2o", "h2o-shared"]


@pytest.fixture(scope="module")
def triton_engine(tiny_model_dir):
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    settings = EngineKVSettings(**ENGINE_KV, allow_request_override=True, check_attention_metadata=True)
    engine = RolloutEngine(str(tiny_model_dir), settings, seed=0, max_total_tokens=2048, max_running_requests=32,
                           attention_backend="triton")
    yield engine
    engine.shutdown()


def _metadata_report(engine) -> dict:
    return engine.internal_state()["sparse_rl_metadata"]


def test_triton_backend_runs_under_the_interpreter(triton_engine):
    assert triton_engine.resolved()["attention_backends"] == ("triton", "triton")
    assert _metadata_report(triton_engine)["triton_interpret"] == "1"  # (the scheduler's environment)


def test_every_policy_on_triton_matches_the_reference_and_reads_only_kept_slots(triton_engine, hf_model,
                                                                                 record_property):
    engine = triton_engine
    single_prompt, group_prompt = [5, 17, 42, 99, 100, 7, 8, 9, 11, 12], list(range(30, 50))
    engine.generate([group_prompt], n_samples=1, max_new_tokens=1)  # the groups' prompt is now cached
    before = engine.kv_stats()
    started = time.perf_counter()
    # every policy's single request and group of 2 decode together: one interpreted step serves them all
    singles = {name: engine.start_generate([single_prompt], n_samples=1, max_new_tokens=10, seed=11,
                                           kv_override=POLICY_CASES[name], ignore_eos=True) for name in POLICIES}
    groups = {name: engine.start_generate([group_prompt], n_samples=2, max_new_tokens=10, seed=5,
                                          kv_override=POLICY_CASES[name], ignore_eos=True) for name in POLICIES}
    results = {(name, kind): pending.result() for kind, started_now in (("single", singles), ("group", groups))
               for name, pending in started_now.items()}
    record_property("decode_seconds", time.perf_counter() - started)
    after = engine.kv_stats()
    report = _metadata_report(engine)
    assert report["mismatches"] == {"lengths": 0, "backend": 0, "fa3": 0, "freed": 0}, report["first_mismatch"]
    # every request's decode steps (its first token comes from the prefill) were compared, by triton's
    # indices and by fa3's table
    decode_steps = sum(len(s.response_ids) - 1 for samples in results.values() for s in samples)
    assert report["compared_rows"] == {"backend": decode_steps, "fa3": decode_steps}, report
    for (name, kind), samples in results.items():
        assert check_samples(samples, hf_model, POLICY_CASES[name], record_property) > 0, (name, kind)
        if kind == "group":
            assert all(s.cached_tokens >= len(group_prompt) - 1 for s in samples), name  # a cache hit
    replayed = [replay_compression(len(s.prompt_ids), len(s.response_ids), ENGINE_KV["budget"], ENGINE_KV["interval"],
                                   policy_of(POLICY_CASES[name]).min_decode_queries).compressions
                for (name, _), samples in results.items() for s in samples]
    assert sum(replayed) == after["compactions"] - before["compactions"] and min(replayed) >= 3, replayed
    assert after["dropped_shared_slots"] > before["dropped_shared_slots"]  # shared prompt slots skipped
    time.sleep(1.5)  # idle: SGLang's strict KV leak check runs (a leaked slot kills the scheduler)
    assert len(engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)) == 1
