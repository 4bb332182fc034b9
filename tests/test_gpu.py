"""The GPU subset (run by tools/gpu_check.sh on a machine with an NVIDIA GPU; skipped elsewhere).

* eviction scoring and the batched attention mass on CUDA tensors choose exactly what they choose
  on the CPU (the engine patch calls them with the KV pool's device tensors);
* the correction on CUDA equals the CPU's;
* the Megatron learner (local spec) on CUDA in float32 and bf16 against transformers; with Transformer
  Engine layers (float32 and bf16) against the local spec and transformers, and with FP8 against bf16
  (skipped, with the reason, without Transformer Engine or on a GPU without FP8)
  (tests/helpers/gpu_learner_check.py);
* the SGLang engine on the GPU against the pure-torch reference decoder, on SGLang's default attention
  backend, triton and flashinfer: StreamingLLM with CUDA graphs (read from the scheduler: captured),
  R-KV per layer and shared with CUDA graphs switched off by the engine (its query hook is Python);
* the weight push's GPU paths into that engine: flattened CUDA buckets through CUDA IPC handles and
  through a broadcast over a gloo weight group (as the engine tests push: tests/helpers/engine_push.py);
  and the trainer's own push (``WeightPush``) over NCCL to a separate engine (needs 2 GPUs);
* the learner's training step at a ~1B Llama shape: tokens/s, MFU and peak memory against --plan
  (tests/helpers/gpu_step_check.py);
* that model's flattened push buckets handed to another process over CUDA IPC, bit for bit, timed
  against a device copy (tests/helpers/gpu_ipc_check.py).
"""
import json
import re

import pytest
import torch

from sparse_rl_mega.kv import build_policy
from sparse_rl_mega.kv.attention_mass import window_attention_mass
from tests.conftest import ROOT, run_torchrun
from tests.helpers.engine_push import DirectPush

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (tools/gpu_check.sh)")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name, selection", [("snapkv", "per_layer"), ("snapkv", "per_head"), ("rkv", "per_layer"),
                                             ("rkv", "per_head"), ("rkv", "shared"), ("h2o", "per_layer")])
def test_policies_choose_the_same_tokens_on_cuda(name, selection):
    g = torch.Generator().manual_seed(0)
    layers, kv_heads, q_heads, length, dim, window = 3, 2, 4, 40, 16, 4
    keys = torch.randn(1, layers, kv_heads, length, dim, generator=g)
    queries = torch.randn(1, layers, q_heads, window, dim, generator=g)
    mass = torch.rand(1, layers, kv_heads, length, generator=g)
    params = {"kernel": 3} if name in ("snapkv", "rkv") else {}
    policy = build_policy(name, sink=2, window=window, selection=selection, **params)
    cpu = policy.select_layers(keys, queries, 16, mass if name == "h2o" else None)
    gpu = policy.select_layers(keys.to(CUDA), queries.to(CUDA), 16, mass.to(CUDA) if name == "h2o" else None)
    assert gpu.device.type == "cuda" and torch.equal(cpu, gpu.cpu())


def test_window_attention_mass_on_cuda():
    g = torch.Generator().manual_seed(1)
    keys, queries = torch.randn(3, 2, 30, 16, generator=g), torch.randn(3, 4, 4, 16, generator=g)
    lengths, counts = torch.tensor([30, 22, 17]), torch.tensor([4, 2, 3])
    cpu = window_attention_mass(keys, queries, 0.25, lengths, counts)
    gpu = window_attention_mass(keys.to(CUDA), queries.to(CUDA), 0.25, lengths.to(CUDA), counts.to(CUDA))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-5)


def test_correction_on_cuda_equals_cpu():
    from sparse_rl_mega.algo.correction import compute_correction

    g = torch.Generator().manual_seed(2)
    logp_old = -torch.rand(8, 20, generator=g, dtype=torch.float64) * 3
    logp_sparse = logp_old + 0.5 * torch.randn(8, 20, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 20, generator=g) > 0.2).double()
    w_cpu, keep_cpu, m_cpu = compute_correction(logp_old, logp_sparse, mask, "sparse_rl")
    w_gpu, keep_gpu, m_gpu = compute_correction(logp_old.to(CUDA), logp_sparse.to(CUDA), mask.to(CUDA), "sparse_rl")
    torch.testing.assert_close(w_gpu.cpu(), w_cpu)
    assert torch.equal(keep_gpu.cpu(), keep_cpu)
    assert m_gpu.keys() == m_cpu.keys()
    # float64 sums of at most 160 terms whose order alone differs by device: far inside 1e-9
    assert m_gpu == pytest.approx(m_cpu, rel=1e-9, abs=1e-12)


def _report_checks(lines: list[str]) -> dict[str, tuple[str, str]]:
    """``{name: (PASS|FAIL|SKIP, detail)}`` from the lines of gpu_learner_check.py's report."""
    checks = {}
    for line in lines:
        status, _, rest = line.partition(" ")
        if status in ("PASS", "FAIL", "SKIP"):
            name, _, detail = rest.partition(": ")
            checks[name] = (status, detail)
    return checks


@pytest.fixture(scope="module")
def learner_report(tiny_model_dir, tmp_path_factory):
    """One run of tests/helpers/gpu_learner_check.py: its checks, report lines, exit status and a log."""
    report = tmp_path_factory.mktemp("learner") / "report.txt"
    proc = run_torchrun(ROOT / "tests" / "helpers" / "gpu_learner_check.py", tiny_model_dir, report,
                        nproc=1, timeout=600)
    lines = report.read_text().splitlines() if report.exists() else []
    log = "\n".join(["report:", *lines, f"exit status {proc.returncode}", proc.stdout[-3000:], proc.stderr[-5000:]])
    return _report_checks(lines), lines, proc.returncode, log


LOCAL_CHECKS = ["fp32 local vs transformers fp32", "bf16 local vs transformers fp32"]
LEARNER_CHECKS = LOCAL_CHECKS + [f"{dtype} transformer_engine vs {b}" for dtype in ("fp32", "bf16")
                                 for b in ("transformers fp32", "local")]


def test_learner_local_spec_on_cuda_against_transformers(learner_report):
    """The Megatron learner (local spec, TP1) on CUDA in float32 and bfloat16 against transformers'
    float32 logprobs of the same weights, under the bounds of tests/helpers/gpu_learner_check.py; the
    bfloat16 bound is shown to catch a wrong weight map, a missing norm and the other rotary layout."""
    checks, lines, _, log = learner_report
    print(log)
    assert "END" in lines, "the helper stopped before its last part\n" + log
    for name in LOCAL_CHECKS + [name for name in checks if name.startswith("bf16 bound catches")]:
        assert checks.get(name, ("missing",))[0] == "PASS", f"{name}\n{log}"


def test_learner_gradient_on_cuda_equals_autograd(tiny_model_dir, tmp_path):
    """One training step's gradient of the full corrected loss (tests/helpers/grad_batch.py: veto,
    rejection, IS weights, PPO and dual clip, KL, entropy, sampled at temperature 0.7 with truncated
    rows) from the learner on CUDA (TP1, float32, 4 micro-batches) against plain autograd through
    transformers in float64 on the CPU, within the float32 rounding bound of tests/test_layout_invariance.py."""
    import json

    from tests.test_layout_invariance import HELPER, LOSS_NAMES, TOLERANCE, _common_factor, _job, _relative_diff, \
        autograd_reference

    job = {**_job("TP1 on CUDA", tiny_model_dir, 1, 1, 2, {}), "dtypes": ["float32"]}
    out = tmp_path / "grads.pt"
    proc = run_torchrun(HELPER, out, json.dumps([job]), nproc=1, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got, ref, bound = torch.load(out, map_location="cpu")[job["name"]]["float32"], autograd_reference(tiny_model_dir), \
        TOLERANCE["float32"]
    diffs = {}
    for mode in LOSS_NAMES:
        assert abs(_common_factor(ref[mode]["grads"], got[mode]["grads"]) - 1) <= bound, mode
        diffs[mode] = _relative_diff(ref[mode]["grads"], got[mode]["grads"])
        assert got[mode]["loss"] == pytest.approx(ref[mode]["loss"], rel=bound), mode
    print("GRAD_FIGURES " + json.dumps({"relative_gradient_difference": diffs, "bound": bound}))
    assert max(diffs.values()) <= bound, diffs


def test_learner_with_transformer_engine(learner_report):
    """Local spec and Transformer Engine layers against transformers and each other (float32, bfloat16),
    under bfloat16 bounds that the helper shows to catch real weight-map / layer-spec mistakes."""
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed")
    checks, lines, returncode, log = learner_report
    print(log)
    assert "END" in lines, "the helper stopped before its last part\n" + log
    bound_checks = [name for name in checks if name.startswith("bf16 bound catches")]
    assert len(bound_checks) >= 3, log
    for name in LEARNER_CHECKS + bound_checks:
        assert checks.get(name, ("missing",))[0] == "PASS", f"{name}\n{log}"
    failed = [name for name, (status, _) in checks.items() if status == "FAIL"]
    assert all(name.startswith("fp8") for name in failed), log  # FP8's own are test_learner_fp8's
    assert returncode == (1 if failed else 0), log


def test_learner_fp8(learner_report):
    """Transformer Engine with FP8 where the GPU supports it: finite, in effect, close to bfloat16."""
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed")
    checks, lines, _, log = learner_report
    assert "END" in lines, "the helper stopped before the FP8 part\n" + log
    fp8 = {name: value for name, value in checks.items() if name.startswith("fp8")}
    if fp8.get("fp8", ("",))[0] == "SKIP":
        pytest.skip(f"FP8 not supported: {fp8['fp8'][1]}")
    assert fp8, "no FP8 check in the report\n" + log
    assert {status for status, _ in fp8.values()} == {"PASS"}, log
    assert any(name.endswith(" vs bf16 transformer_engine") for name in fp8), log


def test_learner_step_throughput_and_memory_against_the_plan(tmp_path):
    """The learner's training step (local spec, TP1, bf16) at Llama-3.2-1B's shape with random weights,
    2 sequences of 4096 tokens: finite losses and gradient norms; tokens/s and MFU against the H200's
    measured bf16 peak, and the peak memory allocated against --plan's estimate for the same config, are
    figures (printed as JSON for tools/gpu_check.py), not bounds."""
    import json

    out = tmp_path / "step.json"
    proc = run_torchrun(ROOT / "tests" / "helpers" / "gpu_step_check.py", out, "--shape", "1b", "--seq", "4096",
                        nproc=1, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    print("STEP_FIGURES " + json.dumps(result))
    assert result["finite"] and result["tokens_per_s"] > 0 and result["peak_allocated_bytes"] > 0, result


def test_flattened_buckets_reach_another_process_over_cuda_ipc(tmp_path):
    """The push's buckets of Llama-3.2-1B's shape (bf16, 512 MiB buckets), packed on the GPU as a push
    packs them, handed to a process of the check's own by CUDA IPC handle and copied out there: every
    HF tensor bit for bit, the hand-over's time against a device-to-device copy of the same bytes
    (printed as figures for tools/gpu_check.py)."""
    import json

    out = tmp_path / "ipc.json"
    proc = run_torchrun(ROOT / "tests" / "helpers" / "gpu_ipc_check.py", out, "--shape", "1b", nproc=1, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    print("IPC_FIGURES " + json.dumps(result))
    assert result["transport"] == "CUDA IPC handle" and result["same_names"] and result["bit_exact"], result
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture
def gpu_engine_env(monkeypatch):
    """SGLang's GPU engine for this test; monkeypatch restores the variable whatever the outcome."""
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")


@pytest.mark.parametrize("attention_backend", [None, "triton", "flashinfer"])
def test_engine_on_gpu_matches_reference_decoder(tiny_model_dir, hf_model, gpu_engine_env, attention_backend):
    """StreamingLLM (compaction only: CUDA graphs stay on) and, per request, R-KV per layer and shared
    (queries recorded in a Python hook: the engine must have switched CUDA graphs off) against the
    pure-torch reference decoder, on SGLang's default attention backend (fa3 on Hopper), triton and
    flashinfer. What the engine runs is read from its scheduler once built (``RolloutEngine.resolved``):
    one token per page, the backend asked for, pytorch sampling, and decode CUDA graphs captured exactly
    when ``cuda_graphs_allowed`` says (torch_native would turn them off by itself: not used here). With
    per-request policies the patch's metadata check runs (``sglang_patches/metadata_check``)."""
    pytest.importorskip("sgl_kernel", reason="SGLang's CUDA kernels are not installed")
    from sparse_rl_mega.kv.engine_settings import ATTENTION_BACKENDS, EngineKVSettings, cuda_graphs_allowed
    from sparse_rl_mega.kv.reference_decoder import ReferenceDecoder
    from sparse_rl_mega.rollout.engine import RolloutEngine

    cases = [(None, build_policy("streaming", sink=2, window=4)),
             ({"policy": "rkv"}, build_policy("rkv", sink=2, window=4)),
             ({"policy": "rkv", "selection": "shared"}, build_policy("rkv", sink=2, window=4, selection="shared"))]
    ref = ReferenceDecoder(hf_model)
    for allow_override in (False, True):
        # (with overrides CUDA graphs are off anyway: every step's eager metadata is checked against the rows)
        settings = EngineKVSettings(policy="streaming", budget=12, sink=2, window=4, interval=2,
                                    allow_request_override=allow_override, check_attention_metadata=allow_override)
        engine = RolloutEngine(str(tiny_model_dir), settings, seed=0, max_total_tokens=4096, max_running_requests=16,
                               attention_backend=attention_backend)
        try:
            resolved = engine.resolved()
            print("ENGINE_RESOLVED " + repr({"asked": attention_backend, "override": allow_override, **resolved}))
            backends = resolved["attention_backends"]
            assert set(backends) <= set(ATTENTION_BACKENDS) and backends != ("torch_native", "torch_native"), resolved
            assert attention_backend is None or set(backends) == {attention_backend}, resolved
            assert resolved["page_size"] == 1 and resolved["sampling_backend"] == "pytorch", resolved
            assert bool(resolved["decode_cuda_graph_bs"]) == cuda_graphs_allowed(settings)[0] == (not allow_override)
            runs = [(override, policy, engine.generate([[5, 6, 7, 8, 9, 10]], n_samples=2, max_new_tokens=24, seed=3,
                                                        kv_override=override))
                    for override, policy in (cases[1:] if allow_override else cases[:1])]
            if allow_override:  # triton's indices (when it runs) and fa3's table are each row's kept slots
                report = engine.internal_state()["sparse_rl_metadata"]
                print("ENGINE_METADATA " + repr({"asked": attention_backend, **report}))
                assert sum(report["mismatches"].values()) == 0, report["first_mismatch"]
                compared = report["compared_rows"]
                assert compared["fa3"] > 0 and (compared["backend"] > 0) == (backends == ("triton", "triton"))
        finally:
            engine.shutdown()
        for override, policy, samples in runs:
            for s in samples:
                logp, evicted = ref.logprobs(s.prompt_ids, s.response_ids, policy, 12, 2)
                assert evicted > 0 and len(logp) == len(s.logp_sparse)
                # float32 GPU kernels vs the CPU reference
                assert max(abs(a - b) for a, b in zip(logp, s.logp_sparse)) < 2e-3, override


def test_engine_on_gpu_takes_flattened_buckets(tiny_model_dir, hf_model, gpu_engine_env):
    """The weight push's GPU paths (rollout/weight_push.py): perturbed HF weights, packed into flattened
    CUDA buckets, reach the engine through CUDA IPC handles (the ``tensor`` sync), then the original ones
    through a broadcast from this process over a gloo weight group (as colocated engines receive); the
    engine's dense logprobs equal transformers' with the weights of each step."""
    import copy

    pytest.importorskip("sgl_kernel", reason="SGLang's CUDA kernels are not installed")
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.learner.weights import buckets, read_hf_state_dict
    from sparse_rl_mega.runtime.ports import free_port
    from sparse_rl_mega.rollout.engine import RolloutEngine

    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
    original = read_hf_state_dict(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    perturbed = {name: t + 0.05 * torch.randn(t.shape, generator=g) for name, t in original.items()}

    def hf_logprobs(weights):
        moved = copy.deepcopy(hf_model)
        moved.load_state_dict(weights, strict=False)
        with torch.no_grad():
            logits = moved(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return [float(logits[t, ids[t + 1]]) for t in range(len(ids) - 1)]

    engine = RolloutEngine(str(tiny_model_dir), EngineKVSettings(policy="none"), seed=0, max_total_tokens=4096,
                           max_running_requests=16, attention_backend="torch_native")
    try:
        on_gpu = lambda weights: [[(n, t.cuda()) for n, t in b] for b in  # noqa: E731
                                  buckets(iter(weights.items()), 64 * 1024, torch.float32)]
        push = DirectPush(engine)
        push.shared(on_gpu(perturbed), version=1)  # CUDA IPC
        via_ipc = engine.dense_logprobs(ids)
        push.connect("127.0.0.1", free_port(), backend="gloo", world_size=2)
        push.broadcast(on_gpu(original), version=2)
        via_broadcast = engine.dense_logprobs(ids)
        served = engine.served_weight_version()
    finally:
        engine.shutdown()
    assert served == "2"
    for got, weights in ((via_ipc, perturbed), (via_broadcast, original)):
        assert max(abs(a - b) for a, b in zip(got, hf_logprobs(weights))) < 2e-3  # float32 GPU kernels vs CPU


def test_trainer_pushes_over_nccl_to_a_separate_engine(tiny_model_dir, gpu_engine_env, tmp_path):
    """The learner's real push (``rollout/fleet.py`` -> ``WeightPush``) over an NCCL weight group, made with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2 and bounded waits on its async broadcasts: a ``separate`` run, the
    learner on GPU 0 and its engine on GPU 1, two iterations; after each push the engine serves the
    learner's weights (its logprobs against the learner's). NCCL refuses two members of one group on one
    GPU, so this needs two."""
    pytest.importorskip("sgl_kernel", reason="SGLang's CUDA kernels are not installed")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: NCCL refuses two members of one weight group on one GPU")
    from tests.conftest import run_launch, write_test_config

    config = write_test_config(tmp_path / "separate.yaml", tiny_model_dir, tmp_path / "run")
    proc = run_launch(config, "--set=parallel.nproc_per_node=1", "--set=rollout.placement=separate",
                      "--set=trainer.sync_method=broadcast", "--set=trainer.iterations=2",
                      "--set=checkpoint.save_interval=0", timeout=540, fresh=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "[iter 2/2]" in proc.stdout and "members: rank 0's (nccl" in proc.stdout, proc.stdout[-3000:]
    diffs = [float(v) for v in re.findall(r"\| sync diff ([0-9.e+-]+) \|", proc.stdout)]  # (train/console.py)
    print("PUSH_FIGURES " + json.dumps({"max_abs_logprob_diff": diffs}))
    assert len(diffs) == 2 and max(diffs) < 2e-3, diffs  # float32 GPU kernels, learner vs engine
