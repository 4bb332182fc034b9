"""The real SGLang engine with the sparse-rl-mega patch, against a pure-torch reference decoder.

One engine serves every test in this module: StreamingLLM by default and, per request, any policy
(``kv_override``), with SGLang's strict idle memory check on, so a leaked or double-freed KV slot
crashes the engine. Budget 12, sink 2, window 4, interval 2: caches swing between 12 and 14 tokens.
"""
import os
import time

import psutil
import pytest
import torch

from sparse_rl_mega.rollout import sglang_internals
from sparse_rl_mega.kv.engine_settings import side_buffer_bytes
from sparse_rl_mega.kv import compression_schedule, replay_compression
from sparse_rl_mega.kv.reference_decoder import ReferenceDecoder
from tests.conftest import ENGINE_KV
from tests.helpers.engine_cases import POLICY_CASES, TOL, check_samples, policy_of
from tests.helpers.engine_push import DirectPush

@pytest.mark.parametrize("name", list(POLICY_CASES))
def test_single_request_matches_reference(evicting_engine, hf_model, name, record_property):
    prompt = [5, 17, 42, 99, 100, 7, 8, 9, 11, 12]
    before = evicting_engine.kv_stats()
    samples = evicting_engine.generate([prompt], n_samples=1, max_new_tokens=24, seed=11,
                                       kv_override=POLICY_CASES[name], ignore_eos=True)
    after = evicting_engine.kv_stats()
    assert check_samples(samples, hf_model, POLICY_CASES[name], record_property) > 0, "budget below the length must evict"
    # one set for every layer compacts the row; a set per layer or head copies K/V into owned slots
    copied = after["copied_tokens"] - before["copied_tokens"]
    assert copied == 0 if policy_of(POLICY_CASES[name]).shared else copied > 0, copied


def test_evaluate_runs_the_release_rkv_it_is_given(evicting_engine, hf_model, tiny_model_dir, record_property):
    """tools/evaluate.py's request for the paper's release R-KV (``--selection shared --sink 0``; kernel 7
    and lambda 0.1 by default; the engine's window and interval) keeps, on the engine, the tokens the
    reference decoder keeps with that policy built from those values."""
    from sparse_rl_mega.cli.evaluate import kv_base, parse_args, parse_kv

    args = parse_args([str(tiny_model_dir), "--benchmarks", "unused", "--kv", f"rkv:{ENGINE_KV['budget']}",
                       "--selection", "shared", "--sink", "0", "--window", str(ENGINE_KV["window"]),
                       "--interval", str(ENGINE_KV["interval"])])
    (_, override), = parse_kv(args.kv, kv_base(args))
    samples = evicting_engine.generate([[5, 17, 42, 99, 100, 7, 8, 9, 11, 12]], n_samples=1, max_new_tokens=24,
                                       seed=11, kv_override=override, ignore_eos=True)
    release = {"policy": "rkv", "selection": "shared", "sink": 0, "params": {"kernel": 7, "lam": 0.1}}
    assert check_samples(samples, hf_model, release, record_property) > 0


@pytest.fixture(scope="module")
def tp2_engine(tiny_model_dir):
    """The same engine settings at TP 2: each scheduler rank holds one of the tiny model's two KV heads."""
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    engine = RolloutEngine(str(tiny_model_dir), EngineKVSettings(**ENGINE_KV, allow_request_override=True), seed=0,
                           max_total_tokens=2048, max_running_requests=16, tp_size=2)
    # SGLang's TP message queues in /dev/shm (~24 MiB), named after the scheduler that made them
    queues = sglang_internals.pid_stamped_shm_files(engine.processes)
    assert queues, sorted(os.listdir(sglang_internals.SHM_DIR))
    yield engine
    # the GPU branch of shutdown: the engine's own processes end, never through SGLang's Engine.shutdown
    # (it kills every child of this process: reward workers, the resource tracker, other engines)
    engine.on_cpu = False

    def refused():
        raise AssertionError("RolloutEngine.shutdown called SGLang's Engine.shutdown")

    engine.engine.shutdown = refused
    pids = list(engine.processes)
    engine.shutdown()  # (its processes end by SIGKILL: SGLang's own unlink does not run)
    assert not [path for path in queues if os.path.exists(path)], queues
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"], pids


@pytest.mark.parametrize("name", ["rkv", "rkv-shared", "snapkv-shared-layer-sum", "h2o"])
def test_tp2_engine_keeps_what_one_rank_would(tp2_engine, hf_model, name, record_property):
    """Per-layer and shared choices gather every KV head's scores over the engine's TP group: at TP 2 the
    sampler equals the reference decoder, which scores all heads at once (each rank alone would keep
    other tokens: a choice from its own head)."""
    samples = tp2_engine.generate([list(range(30, 46)), [5, 17, 42, 99, 100, 7, 8]], n_samples=2, max_new_tokens=20,
                                  seed=3, kv_override=POLICY_CASES[name], ignore_eos=True)
    assert check_samples(samples, hf_model, POLICY_CASES[name], record_property) > 0


def test_tp2_engine_takes_broadcast_weights(tp2_engine, tiny_model_dir, hf_model):
    """The broadcast weight path into an engine at TP 2 (each scheduler rank keeps its half of every
    head-split tensor): this process is member 0 of a gloo group with both engine ranks, as the
    learner's rank 0 is; HF-named buckets of perturbed weights are broadcast, after which the engine's
    dense logprobs equal transformers' with those weights (and differed before); then the original
    weights go back the same way."""
    import copy

    from sparse_rl_mega.learner.weights import buckets, read_hf_state_dict
    from sparse_rl_mega.runtime.ports import free_port

    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
    original = read_hf_state_dict(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=g) for name, t in original.items()}
    moved = copy.deepcopy(hf_model)
    moved.load_state_dict(perturbed, strict=False)
    with torch.no_grad():
        logits = moved(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = [float(logits[t, ids[t + 1]]) for t in range(len(ids) - 1)]

    push = DirectPush(tp2_engine)
    push.connect("127.0.0.1", free_port(), backend="gloo", world_size=3)
    before = tp2_engine.dense_logprobs(ids)
    version = push.broadcast(buckets(iter(perturbed.items()), 64 * 1024, torch.float32))
    after = tp2_engine.dense_logprobs(ids)
    push.broadcast(buckets(iter(original.items()), 64 * 1024, torch.float32))
    restored = tp2_engine.dense_logprobs(ids)
    # the same through shared memory: both scheduler ranks map each flattened bucket this process packed
    push.shared(buckets(iter(perturbed.items()), 64 * 1024, torch.float32))
    shared = tp2_engine.dense_logprobs(ids)
    push.shared(buckets(iter(original.items()), 64 * 1024, torch.float32))
    assert version == 1 and tp2_engine.served_weight_version() == "4"
    assert len(after) == len(before) == len(expected)
    assert max(abs(a - b) for a, b in zip(before, expected)) > 1e-2  # the perturbation shows
    assert max(abs(a - b) for a, b in zip(after, expected)) < TOL
    assert max(abs(a - b) for a, b in zip(shared, expected)) < TOL
    assert max(abs(a - b) for a, b in zip(restored, before)) < TOL  # restored
    assert max(abs(a - b) for a, b in zip(tp2_engine.dense_logprobs(ids), before)) < TOL


@pytest.mark.parametrize("name", list(POLICY_CASES))
def test_group_sharing_a_cached_prompt_matches_reference(evicting_engine, hf_model, name, record_property):
    prompt = list(range(30, 50))  # 20 tokens: longer than the budget, so shared tree slots are evicted too
    evicting_engine.generate([prompt], n_samples=1, max_new_tokens=1)  # the group's prompt is now cached
    before = evicting_engine.kv_stats()
    samples = evicting_engine.generate([prompt], n_samples=4, max_new_tokens=20, seed=5,
                                       kv_override=POLICY_CASES[name], ignore_eos=True)
    after = evicting_engine.kv_stats()
    assert all(s.cached_tokens >= len(prompt) - 1 for s in samples)  # the shared prompt is a cache hit
    assert check_samples(samples, hf_model, POLICY_CASES[name], record_property) > 0
    assert after["dropped_shared_slots"] > before["dropped_shared_slots"]  # skipped, not freed


@pytest.mark.parametrize("name", ["streaming", "rkv"])
def test_per_request_compression_counts_follow_from_lengths(evicting_engine, name):
    """The trainer's per-sample metrics replay the trigger; the engine's counters must agree."""
    case = POLICY_CASES[name]
    before = evicting_engine.kv_stats()
    samples = evicting_engine.generate([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]], n_samples=2,
                                       max_new_tokens=33, seed=4, kv_override=case, ignore_eos=True)
    after = evicting_engine.kv_stats()
    needed = policy_of(case).min_decode_queries
    replayed = [replay_compression(len(s.prompt_ids), len(s.response_ids), ENGINE_KV["budget"],
                                   ENGINE_KV["interval"], needed) for s in samples]
    assert sum(r.compressions for r in replayed) == after["compactions"] - before["compactions"] > 0
    assert sum(r.evicted_tokens for r in replayed) == after["evicted_tokens"] - before["evicted_tokens"]
    # the most KV one request held (the engine's own measure, since the last read) is the replayed one
    assert after["peak_request_tokens"] == max(r.peak_tokens for r in replayed)


@pytest.mark.parametrize("name", ["streaming", "rkv"])
def test_newline_trigger_compresses_at_line_ends(evicting_engine, hf_model, name):
    """With the newline trigger a request past the budget is also compressed before decoding a token
    that ends a line; here every even token id plays the newline, so the trigger fires often."""
    line_ends = list(range(0, 384, 2))
    case = {**POLICY_CASES[name], "newline_token_ids": line_ends}
    before = evicting_engine.kv_stats()
    samples = evicting_engine.generate([[5, 6, 7, 8, 9, 10, 11]], n_samples=3, max_new_tokens=30, seed=9,
                                       kv_override=case, ignore_eos=True)
    after = evicting_engine.kv_stats()
    ref = ReferenceDecoder(hf_model)
    needed = policy_of(case).min_decode_queries
    with_newlines = length_only = 0
    for s in samples:
        logp, _ = ref.logprobs(s.prompt_ids, s.response_ids, policy_of(case), ENGINE_KV["budget"],
                               ENGINE_KV["interval"], newline_token_ids=line_ends)
        assert max(abs(a - b) for a, b in zip(logp, s.logp_sparse)) < TOL
        newline_at = [t in line_ends for t in s.response_ids]
        with_newlines += compression_schedule(len(s.prompt_ids), len(s.response_ids), ENGINE_KV["budget"],
                                              ENGINE_KV["interval"], needed, newline_at)[0]
        length_only += compression_schedule(len(s.prompt_ids), len(s.response_ids), ENGINE_KV["budget"],
                                             ENGINE_KV["interval"], needed)[0]
    assert after["compactions"] - before["compactions"] == with_newlines > length_only


def test_response_text_is_the_whole_decode_of_its_tokens(evicting_engine, tiny_model_dir):
    """The text that rewards and the console read is the response's tokens decoded together: SGLang
    assembles it from incremental pieces, which must not cut a character that spans several byte-level
    tokens. Sampled hot from a prompt with multi-byte characters, the tiny byte-level model also emits
    bytes that form no character: those are U+FFFD in the whole decode too."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer("caf\u00e9 \u20ac 3 + 4 =")["input_ids"]
    samples = evicting_engine.generate([prompt], n_samples=16, max_new_tokens=24, temperature=1.5, seed=3)
    for sample in samples:
        assert sample.response_text == tokenizer.decode(sample.response_ids, skip_special_tokens=True)


def truncated_support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, slack: float
                      ) -> torch.Tensor:
    """``[T, V]`` bool: the tokens a top-k, then top-p truncation of ``softmax(logits / temperature)``
    keeps, read from SGLang 0.5.23's pytorch sampler (``top_k_top_p_min_p_sampling_from_probs_torch``):
    sorted by probability, a token is kept if fewer than ``top_k`` are before it and the mass before it
    (of the untruncated distribution) is at most ``top_p``. ``slack`` > 0 gives the widest set that
    probabilities off by ``slack`` could give, ``slack`` < 0 the narrowest."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(dim=-1) - sorted_probs <= top_p + slack
    if top_k > 0:  # in the top k: at least the k-th probability (widest), above the (k+1)-th (narrowest)
        if slack > 0:
            keep &= sorted_probs >= sorted_probs[:, top_k - 1:top_k] - slack
        else:
            keep &= sorted_probs > sorted_probs[:, top_k:top_k + 1] - slack
    return torch.zeros_like(keep).scatter(-1, order, keep)


@pytest.mark.parametrize("truncation", [{"top_k": 5}, {"top_p": 0.9}, {"top_k": 5, "top_p": 0.9}])
@pytest.mark.parametrize("name", ["dense", "rkv"])
def test_truncated_sampling_reports_the_distribution_it_drew_from(evicting_engine, hf_model, truncation, name,
                                                                  record_property):
    """At temperature 0.8 with top-k / top-p, each token's reported support is the truncation of the
    reference decoder's distribution (same eviction), computed here from SGLang's rule, and its reported
    logprob is the sampled token's probability renormalised over that support: the behaviour
    probability the correction divides by. Borderline tokens (within float rounding of a cut) may go
    either way; the truncation must have cut mass somewhere (else nothing is shown)."""
    temperature, top_k, top_p = 0.8, truncation.get("top_k", -1), truncation.get("top_p", 1.0)
    case = {"policy": "none"} if name == "dense" else POLICY_CASES[name]
    samples = evicting_engine.generate([[5, 17, 42, 99, 100, 7, 8, 9, 11, 12], list(range(30, 40))], n_samples=4,
                                       max_new_tokens=20, temperature=temperature, top_p=top_p, top_k=top_k, seed=21,
                                       kv_override=case, ignore_eos=True, report_support=True)
    ref = ReferenceDecoder(hf_model)
    policy = None if name == "dense" else policy_of(case)
    sizes, cut_mass = [], 0.0
    for s in samples:
        logits, _ = ref.logits(s.prompt_ids, s.response_ids, policy, ENGINE_KV["budget"], ENGINE_KV["interval"])
        assert len(s.support) == len(s.response_ids) == len(s.logp_sparse)
        widest = truncated_support(logits, temperature, top_k, top_p, slack=1e-5)
        narrowest = truncated_support(logits, temperature, top_k, top_p, slack=-1e-5)
        for t, ids in enumerate(s.support):
            reported = torch.zeros(logits.shape[1], dtype=torch.bool)
            reported[ids] = True
            assert len(set(ids)) == len(ids) and s.response_ids[t] in ids, (t, ids)
            assert bool((reported <= widest[t]).all()) and bool((narrowest[t] <= reported).all()), (t, ids)
            sizes.append(len(ids))
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        cut_mass = max(cut_mass, max(1 - float(probs[t, ids].sum()) for t, ids in enumerate(s.support)))
        behaviour, _ = ref.logprobs(s.prompt_ids, s.response_ids, policy, ENGINE_KV["budget"], ENGINE_KV["interval"],
                                    temperature=temperature, supports=s.support)
        gap = max(abs(a - b) for a, b in zip(behaviour, s.logp_sparse))
        record_property("max_abs_behaviour_logprob_gap", gap)
        assert gap < TOL, (truncation, name, gap)
    assert max(sizes) > 1 and cut_mass > 10 * TOL, (sizes, cut_mass)  # the truncation mattered
    if top_k > 0:
        assert max(sizes) <= top_k


def test_unknown_override_is_refused_before_reaching_the_engine(evicting_engine):
    with pytest.raises(ValueError, match="unknown KV settings"):
        evicting_engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2, kv_override={"budgett": 4})
    with pytest.raises(ValueError, match="must exceed sink"):
        evicting_engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2, kv_override={"budget": 5})


def test_flush_waits_until_the_engine_is_idle(evicting_engine):
    """SGLang refuses a flush while a request is running, or has just finished and is still in the
    scheduler's last batch (until its next idle pass), and says so only in a warning. A request is
    left running here when the flush is asked: ``flush_cache`` asks again until SGLang empties the
    cache, so the next request finds nothing of it cached."""
    import asyncio

    from sparse_rl_mega.rollout import sglang_internals

    engine, prompt, answers = evicting_engine, [3, 4, 5, 6, 7, 8, 9, 10, 11], []
    sglang_flush = sglang_internals.flush_cache

    async def counted_flush(sglang_engine):
        answers.append(await sglang_flush(sglang_engine))
        return answers[-1]
    sglang_internals.flush_cache = counted_flush  # (SGLang still answers: this only records its answers)
    try:
        steps_before = engine.kv_stats()["decode_steps"]
        running = engine._submit(sglang_internals.generate(engine.engine, prompt, {"max_new_tokens": 450,
                                                                                    "ignore_eos": True}))
        deadline = time.time() + 30
        while engine.kv_stats()["decode_steps"] == steps_before:  # it decodes (a sleep raced a fast machine)
            assert time.time() < deadline and not running.done()
            engine._call("test", asyncio.sleep(0.005))
        engine.flush_cache()  # (not owed: the request was sent beside the engine's own generations)
        assert running.done() and answers[0] is False and answers[-1] is True, answers
    finally:
        sglang_internals.flush_cache = sglang_flush
    (again,) = engine.generate([prompt], n_samples=1, max_new_tokens=1)
    assert again.cached_tokens == 0
    engine.flush_cache()


@pytest.mark.parametrize("name", ["streaming", "rkv", "h2o"])
def test_peak_pool_use_of_a_group_is_bounded(evicting_engine, name):
    """A group of n samples holds at most prompt + n x (budget + interval) slots at any time."""
    prompt, n, new_tokens = [3, 4, 5, 6, 7, 8], 4, 40
    evicting_engine.flush_cache()
    evicting_engine.kv_stats()  # resets the peak
    evicting_engine.generate([prompt], n_samples=n, max_new_tokens=new_tokens, seed=2,
                             kv_override=POLICY_CASES[name], ignore_eos=True)
    stats = evicting_engine.kv_stats()
    bound = len(prompt) + n * (ENGINE_KV["budget"] + ENGINE_KV["interval"])
    assert 0 < stats["peak_slots_in_use"] <= bound, stats
    assert bound < n * (len(prompt) + new_tokens)  # what dense decoding needs: the bound is binding
    # side buffers: the ring has a row per request slot (max_running_requests 16 + SGLang's padding row);
    # H2O's mass is held for running requests only, within the bound --plan counts for them
    side = side_buffer_bytes(evicting_engine.kv, running_requests=n, layers=4, q_heads=4, kv_heads=2, head_dim=16,
                             dtype_bytes=4, prompt_tokens=len(prompt))
    ring = side_buffer_bytes(evicting_engine.kv, running_requests=16, layers=4, q_heads=4, kv_heads=2, head_dim=16,
                             dtype_bytes=4, prompt_tokens=len(prompt))["query_ring"]
    assert stats["query_ring_bytes"] == ring
    if name == "h2o":
        assert 0 < stats["h2o_mass_peak_bytes"] <= side["h2o_mass"], (stats, side)
        evicting_engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=3)  # the next decode steps ...
        assert evicting_engine.kv_stats()["h2o_mass_bytes"] == 0  # ... free what finished requests held


def _wait_for_decode_steps(engine, steps: int, timeout_s: float = 60.0) -> None:
    """Until the engine ran ``steps`` more decode batches (its requests are mid-response)."""
    first = engine.kv_stats()["decode_steps"]
    deadline = time.time() + timeout_s
    while engine.kv_stats()["decode_steps"] < first + steps:
        assert time.time() < deadline, f"no {steps} decode steps in {timeout_s} s"
        time.sleep(0.01)


@pytest.mark.parametrize("kv", ["stale", "reprefill"])
def test_a_request_paused_by_a_weight_push_resumes_as_the_reference_replays_it(evicting_engine, hf_model,
                                                                                tiny_model_dir, kv, record_property):
    """Partial rollouts (rollout.partial): requests mid-response under R-KV are paused, perturbed
    weights are pushed, and they resume. Each response's tokens carry the version that sampled them (the
    first ones the old, the rest the new), and every logprob is the reference decoder's: with "stale"
    the compressed KV computed by the old weights is kept and only later steps run the new weights (the
    same kept positions as the replay); with "reprefill" the prompt and output so far are prefilled
    again, dense, under the new weights and compression starts anew. While paused the requests keep at
    most budget + interval + 1 slots each ("stale"). The original weights go back at the end."""
    import copy

    from sparse_rl_mega.learner.weights import buckets, read_hf_state_dict

    engine, case = evicting_engine, POLICY_CASES["rkv"]
    original = read_hf_state_dict(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=g) for name, t in original.items()}
    moved = copy.deepcopy(hf_model)
    moved.load_state_dict(perturbed, strict=False)
    prompt = [5, 17, 42, 99, 100, 7, 8, 9]
    push = DirectPush(engine)
    engine.flush_cache()
    engine.kv_stats()  # (resets the peak)
    old = engine.weight_version
    pending = engine.start_generate([prompt], n_samples=2, max_new_tokens=300, seed=4, kv_override=case,
                                    ignore_eos=True)
    _wait_for_decode_steps(engine, 20)
    assert engine.pause(kv) == 1
    paused_peak = engine.kv_stats()["peak_request_tokens"]
    new = push.shared(buckets(iter(perturbed.items()), 64 * 1024, torch.float32))
    engine.resume()
    samples = pending.result()
    push.shared(buckets(iter(original.items()), 64 * 1024, torch.float32))
    assert engine.pause(kv) == 0  # nothing in flight: nothing to pause

    reference, reference_new = ReferenceDecoder(hf_model), ReferenceDecoder(moved)
    policy, budget, interval = policy_of(case), ENGINE_KV["budget"], ENGINE_KV["interval"]
    for s in samples:
        n = s.token_versions.count(old)
        assert 0 < n < len(s.response_ids) == 300 and s.token_versions == [old] * n + [new] * (300 - n), \
            s.token_versions
        if kv == "stale":
            expected, _ = reference.logprobs(prompt, s.response_ids, policy, budget, interval,
                                             later_model=(n, moved))
        else:
            expected, _ = reference.logprobs(prompt, s.response_ids[:n], policy, budget, interval)
            rest, _ = reference_new.logprobs(prompt + s.response_ids[:n], s.response_ids[n:], policy, budget,
                                             interval)
            expected += rest
        gap = max(abs(a - b) for a, b in zip(expected, s.logp_sparse))
        record_property("max_abs_logprob_gap", gap)
        assert gap < TOL, (kv, n, gap)
        unswitched, _ = reference.logprobs(prompt, s.response_ids, policy, budget, interval)
        assert max(abs(a - b) for a, b in zip(unswitched[n:], s.logp_sparse[n:])) > 10 * TOL  # the push shows
    assert paused_peak <= budget + interval + 1, paused_peak
    time.sleep(1.5)  # idle: SGLang's strict KV leak check runs (a leak ends the scheduler: the next call fails)
    assert len(engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)) == 1


def test_200_pauses_and_pushes_leak_no_kv_slot(evicting_engine, tiny_model_dir):
    """200 pause/resume cycles over a generation of four R-KV requests, alternating the two KV choices,
    the same weights pushed at every tenth as a new version: every request ends with its full length,
    its tokens in the versions it lived through, and SGLang's strict idle check then finds every KV
    slot back (a leaked or double-freed slot ends the scheduler: the next call fails)."""
    from sparse_rl_mega.learner.weights import buckets, read_hf_state_dict

    engine, weights = evicting_engine, read_hf_state_dict(tiny_model_dir)
    push, first = DirectPush(engine), engine.weight_version
    pending = engine.start_generate([[5, 6, 7, 8], [9, 10, 11]], n_samples=2, max_new_tokens=480, seed=1,
                                    kv_override=POLICY_CASES["rkv"], ignore_eos=True)
    _wait_for_decode_steps(engine, 5)
    paused = 0
    for cycle in range(200):
        paused += engine.pause("stale" if cycle % 2 else "reprefill")
        if cycle % 10 == 0:
            push.shared(buckets(iter(weights.items()), 256 * 1024, torch.float32))
        engine.resume()
    samples = pending.result()
    assert paused >= 100, paused  # (the generation ran through most cycles)
    for s in samples:
        assert len(s.response_ids) == 480 and s.token_versions == sorted(s.token_versions), s.token_versions[:8]
        assert first <= s.token_versions[0] and s.token_versions[-1] <= engine.weight_version
    assert max(len(set(s.token_versions)) for s in samples) > 2
    engine.flush_cache()
    time.sleep(1.5)  # idle: SGLang's strict KV leak check runs
    engine.kv_stats()  # (resets the peak)
    assert len(engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)) == 1
    assert engine.kv_stats()["peak_slots_in_use"] <= 5  # only that request's 3 + 2 slots are in use


def test_engine_frees_evicted_slots_and_survives_idle_leak_check(evicting_engine):
    before = evicting_engine.kv_stats()
    for name in POLICY_CASES:
        evicting_engine.generate([[3, 4, 5, 6, 7]], n_samples=3, max_new_tokens=30, seed=2,
                                 kv_override=POLICY_CASES[name], ignore_eos=True)
    after = evicting_engine.kv_stats()
    assert after["freed_slots"] > before["freed_slots"]
    time.sleep(1.5)  # scheduler idles -> SGLang's strict KV leak check runs
    assert len(evicting_engine.generate([[1, 2, 3]], n_samples=2, max_new_tokens=2)) == 2


def test_dense_prefill_logprobs_equal_hf(evicting_engine, hf_model):
    ids = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # longer than the budget
    engine_logp = evicting_engine.dense_logprobs(ids)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    hf_logp = [float(logits[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(engine_logp, hf_logp, strict=True)) < TOL


def test_idle_engine_leaves_the_cpu_to_the_learner(evicting_engine):
    """Between rollouts the learner trains on the same cores: an idle scheduler must sleep, not poll
    (SGLang's default loop keeps one core at 100 %; measured 5.0 CPU-seconds per idle 5 s without
    ``sleep_on_idle``, 0.09 with it)."""
    import time

    import psutil

    evicting_engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)
    schedulers = [p for p in psutil.Process().children(recursive=True) if "scheduler" in p.name()]
    assert schedulers
    time.sleep(1.0)  # let it reach its idle loop
    used = lambda: sum(p.cpu_times().user + p.cpu_times().system for p in schedulers)  # noqa: E731
    before = used()
    time.sleep(3.0)
    assert used() - before < 1.0  # busy polling would use ~3 CPU-seconds


def test_the_scheduler_reports_what_sglang_resolved(evicting_engine):
    """What the scheduler runs, read from it once built (sglang_internals.hook_scheduler_built, the same
    dict its start-up check refuses): one token per page, the requested attention backend for prefill and
    decode from its model runner, seeded pytorch sampling, no overlap or speculation, and no decode CUDA
    graph (a CPU engine captures none; tests/test_gpu.py asserts them captured where allowed)."""
    assert evicting_engine.resolved() == {"page_size": 1, "attention_backends": ("torch_native", "torch_native"),
                                          "sampling_backend": "pytorch", "overlap": False, "speculative": None,
                                          "decode_cuda_graph_bs": []}


def test_cpu_engine_processes_sample_eagerly(evicting_engine):
    """SGLang's seeded sampling is a ``torch.compile`` function: on the CPU the engine's processes run
    without dynamo (a new scheduler's first seeded request would spend ~13 s tracing it and loading
    inductor's kernel), so after seeded requests no inductor-compiled library is mapped in the scheduler;
    the trainer's own process keeps its setting."""
    import os

    import psutil

    evicting_engine.generate([[1, 2, 3]], n_samples=2, max_new_tokens=4, seed=5)
    schedulers = [p for p in psutil.Process().children(recursive=True) if "scheduler" in p.name()]
    assert schedulers
    for scheduler in schedulers:
        compiled = [m.path for m in scheduler.memory_maps() if "torchinductor" in m.path]
        assert not compiled, compiled
    assert "TORCHDYNAMO_DISABLE" not in os.environ


def test_a_killed_engine_process_is_named_and_the_next_engine_forks_from_the_same_server(evicting_engine,
                                                                                        tiny_model_dir):
    """CPU engines fork their processes from one server per process that imported SGLang once
    (sparse_rl_mega/rollout/forkserver.py). A SIGKILLed scheduler fails the engine's next call with its
    signal (the exit code comes through the server: the scheduler is not this process's child); the
    SIGQUIT that a failing SGLang process sends its parent does not end the server: the other engine
    (the module's) still answers, and a new engine starts as a fork of the same server."""
    import os
    import signal

    import psutil

    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import EngineFailure, RolloutEngine

    def server_of(engine) -> int:
        return psutil.Process(next(iter(engine.processes))).ppid()

    server = server_of(evicting_engine)
    assert server != os.getpid() and psutil.Process(server).ppid() == os.getpid(), evicting_engine.started
    engine = RolloutEngine(str(tiny_model_dir), EngineKVSettings(**ENGINE_KV), seed=0, max_total_tokens=512,
                           max_running_requests=4, name="victim")
    # SGLang's scheduler publishes its load in a /dev/shm file it never removes
    shm_files = [sglang_internals.load_snapshot_file(engine.engine)]
    try:
        assert engine.forked and server_of(engine) == server
        scheduler = next(pid for pid, name in engine.processes.items() if name == "scheduler")
        os.kill(scheduler, signal.SIGKILL)
        with pytest.raises(EngineFailure, match=rf"victim failed in rollout: its scheduler process \(pid {scheduler}\) "
                                                r"died \(killed by signal 9, SIGKILL\)"):
            engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)
    finally:
        engine.kill()
    os.kill(server, signal.SIGQUIT)  # what a scheduler that fails (raises) sends its parent
    time.sleep(0.5)
    assert psutil.Process(server).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    assert len(evicting_engine.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)) == 1
    again = RolloutEngine(str(tiny_model_dir), EngineKVSettings(**ENGINE_KV), seed=0, max_total_tokens=512,
                          max_running_requests=4)
    try:
        assert server_of(again) == server
        assert len(again.generate([[1, 2, 3]], n_samples=1, max_new_tokens=2)) == 1
        shm_files.append(sglang_internals.load_snapshot_file(again.engine))
        assert os.path.exists(shm_files[-1]), shm_files
    finally:
        again.shutdown()
    assert not set(again.processes) & {p.pid for p in psutil.Process().children(recursive=True)}
    # gone with the engine, whether killed (the victim) or shut down
    assert not [path for path in shm_files if os.path.exists(path)], shm_files


# Llama-3.1's RoPE scaling (llama3: factor 8, frequency factors 1 / 4) over 64 original positions, on the tiny
# model's weights: its heads of 16 at theta 1e4 have wavelengths 6.3 (kept), 19.9 and 62.8 (blended), 199 and
# longer (stretched 8x); the learner's logits with the same config.json equal transformers' in float64
# (tests/test_learner.py, model llama3-rope)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def test_engine_reads_llama3_rope_scaling_from_config_json(tiny_model_dir, hf_model, tmp_path, record_property):
    """SGLang takes RoPE scaling from the HF folder's config.json itself: a dense engine on the tiny model
    whose config.json says llama3 samples 150 tokens (positions up to 160, past the original 64) with the
    logprobs of transformers' model of that folder, within the sampler's bound, and its prefill's dense
    logprobs too; transformers' plain-RoPE model of the same weights is far off there."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    folder = tmp_path / "tiny-llama3-rope"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": config["rope_parameters"]["rope_theta"]}
    (folder / "config.json").write_text(json.dumps(config))
    scaled = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = RolloutEngine(str(folder), EngineKVSettings(), seed=0, max_total_tokens=1024, max_running_requests=2)
    try:
        [sample] = engine.generate([[5, 17, 42, 99, 100, 7, 8, 9, 11, 12]], n_samples=1, max_new_tokens=150,
                                   seed=5, ignore_eos=True)
        ids = sample.prompt_ids + sample.response_ids
        prefill = engine.dense_logprobs(ids)
    finally:
        engine.shutdown()
    logp, _ = ReferenceDecoder(scaled).logprobs(sample.prompt_ids, sample.response_ids)
    plain, _ = ReferenceDecoder(hf_model).logprobs(sample.prompt_ids, sample.response_ids)
    gap = max(abs(a - b) for a, b in zip(logp, sample.logp_sparse, strict=True))
    record_property("max_abs_logprob_gap", gap)
    assert len(sample.response_ids) == 150 and gap < TOL, gap
    with torch.no_grad():
        ref = scaled(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    assert max(abs(a - float(ref[t, ids[t + 1]])) for t, a in enumerate(prefill)) < TOL
    assert max(abs(a - b) for a, b in zip(plain, sample.logp_sparse)) > 10 * TOL  # the scaling matters
