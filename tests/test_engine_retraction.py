"""Compressed requests survive SGLang retracting them (``SGLANG_TEST_RETRACT`` makes the scheduler
retract running requests every few steps): every request finishes with its full length, the engine's
KV accounting stays exact (strict idle leak check) and compression resumes after the dense restart."""
import os
import time

import pytest

from tests.conftest import ENGINE_KV


@pytest.fixture(scope="module")
def retracting_engine(tiny_model_dir):
    from sglang_patches.settings import EngineKVSettings
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
