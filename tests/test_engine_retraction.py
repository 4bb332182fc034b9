"""Compressed requests survive SGLang retracting them (``SGLANG_TEST_RETRACT`` makes the scheduler
retract running requests every few steps): every request finishes with its full length, the engine's
KV accounting stays exact (strict idle leak check) and compression resumes after the dense restart."""
import os
import time

import pytest

from sparse_rl_mega.rollout import sglang_internals
from tests.conftest import ENGINE_KV


@pytest.fixture(scope="module")
def retracting_engine(tiny_model_dir):
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    forced = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5"}
    saved = {k: os.environ.get(k) for k in forced}
    os.environ.update(forced)  # read by the scheduler process at spawn
    try:
        engine = RolloutEngine(str(tiny_model_dir), EngineKVSettings(**ENGINE_KV, allow_request_override=True),
                               seed=0, max_total_tokens=2048, max_running_requests=16)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    # (read as SGLang's scheduler module is imported: when an engine of another environment started this
    # process's forkserver, this one is spawned; sparse_rl_mega/rollout/forkserver.py)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("policy", ["streaming", "rkv", "h2o"])
def test_retracted_compressed_requests_finish_and_leak_nothing(retracting_engine, policy):
    before = retracting_engine.kv_stats()
    samples = retracting_engine.generate([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]], n_samples=3, max_new_tokens=40,
                                         seed=3, kv_override={"policy": policy}, ignore_eos=True)
    after = retracting_engine.kv_stats()
    assert [len(s.response_ids) for s in samples] == [40] * 6
    assert all(len(s.logp_sparse) == 40 for s in samples)
    assert after["retractions"] > before["retractions"]  # the scheduler really retracted requests
    assert after["compactions"] > before["compactions"]  # compression resumed after the restarts
    time.sleep(1.5)  # idle: SGLang's strict KV leak check runs
    assert len(retracting_engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)) == 1


def test_soak_mixed_policies_retractions_and_client_aborts(retracting_engine):
    """1000 requests in 4 waves on one engine: per-request KV policies (streaming, rkv, snapkv, h2o and
    dense), SGLang's parallel sampling (``n`` = 2 and 4 in two waves), forced retractions, and 10 % of the requests aborted
    by the client while in flight. Every request ends (full length, or aborted), SGLang's strict idle
    leak check then passes (the scheduler would crash on a leak), and the pool is back to its idle use."""
    import random

    engine = retracting_engine
    rng = random.Random(0)
    policies = ["streaming", "rkv", "snapkv", "h2o", "none"]
    before = engine.kv_stats()
    finished: dict[str, int] = {}
    requests = 0
    for wave, n in enumerate([2, 1, 4, 1]):  # n: SGLang's parallel sampling (n answers to one request; one n per call)
        prompts, params, rids = [], [], []
        while requests < 250 * (wave + 1):
            policy = rng.choice(policies)
            prompts.append([rng.randrange(3, 300) for _ in range(rng.randint(3, 12))])
            params.append({"max_new_tokens": rng.randint(4, 24), "temperature": 1.0, "ignore_eos": True, "n": n,
                           "sampling_seed": requests, "custom_params": {"sparse_rl_kv": {"policy": policy}}})
            rids.append(f"soak-{wave}-{len(rids)}")
            requests += n
        pending = engine._submit(sglang_internals.generate(engine.engine, prompts, params, rids))
        time.sleep(0.5)  # the wave is running: the client gives up on some of it
        manager, loop = engine.engine.tokenizer_manager, engine.engine.loop
        for rid in rng.sample(rids, len(rids) // 10):
            loop.call_soon_threadsafe(manager.abort_request, rid)
        outputs = engine._wait("soak", pending)
        expected = [p["max_new_tokens"] for p in params for _ in range(p["n"])]
        assert len(outputs) == len(expected)
        for out, length in zip(outputs, expected):
            reason = (out["meta_info"].get("finish_reason") or {}).get("type", "?")
            finished[reason] = finished.get(reason, 0) + 1
            if reason != "abort":
                assert reason == "length" and len(out["output_ids"]) == length, (reason, len(out["output_ids"]), length)
    after = engine.kv_stats()
    assert sum(finished.values()) >= 1000 and finished.get("abort", 0) > 0 and finished.get("length", 0) > 800, finished
    assert after["retractions"] > before["retractions"] and after["compactions"] > before["compactions"]
    engine.flush_cache()
    time.sleep(1.5)  # idle: SGLang's strict KV leak check runs (a leak ends the scheduler: the next call fails)
    engine.kv_stats()  # resets the peak
    assert len(engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)) == 1
    assert engine.kv_stats()["peak_slots_in_use"] <= 5  # only that request's 3 + 2 slots are in use
