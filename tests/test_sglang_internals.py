"""The one module that touches SGLang's internals (sparse_rl_mega/rollout/sglang_internals.py): it is the only
one, and it refuses any SGLang but the one it was written for, in the trainer and in SGLang's processes."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparse_rl_mega.rollout import sglang_internals
from sparse_rl_mega.kv.engine_settings import ENV_VAR
from sparse_rl_mega.rollout.sglang_internals import SGLANG_VERSION, SGLangVersionError

ROOT = Path(__file__).resolve().parent.parent
OTHER = "0.6.1"  # a faked other SGLang


def test_another_sglang_is_refused_with_one_line():
    sglang_internals.check_version()  # the pinned one, installed here
    with pytest.raises(SGLangVersionError) as info:
        sglang_internals.check_version(OTHER)
    message = str(info.value)
    assert "\n" not in message
    assert f"written for sglang {SGLANG_VERSION}, and sglang {OTHER} is installed" in message
    assert f"install sglang=={SGLANG_VERSION}" in message


def test_an_engine_and_the_plugin_refuse_another_sglang_before_starting(monkeypatch):
    """The trainer's engine refuses before any SGLang process starts; the plugin, which SGLang loads
    in each of its processes, refuses before it installs a hook."""
    import sglang_patches
    from sglang_patches import kv_eviction
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    monkeypatch.setattr(sglang_internals, "installed_version", lambda: OTHER)
    with pytest.raises(SGLangVersionError, match=f"sglang {OTHER} is installed"):
        RolloutEngine("no/model/needed", EngineKVSettings())
    installed = []
    monkeypatch.setattr(kv_eviction, "install", installed.append)
    monkeypatch.setattr(sglang_patches, "_installed", False)
    with pytest.raises(SystemExit, match=f"SGLangVersionError: .*sglang {OTHER} is installed"):
        sglang_patches.register()
    assert installed == [] and not sglang_patches._installed


def test_a_failing_plugin_ends_the_sglang_process_instead_of_leaving_it_dense():
    """SGLang's plugin loader logs and swallows an Exception from a plugin: an engine whose KV settings
    the plugin refuses would then decode dense under a compressed label (seen: evaluate.py's engine at
    budget 32 with --sink 24 reported R-KV 56 with 0 evicted tokens). Through SGLang's own loader, the
    process must end with the plugin's one line."""
    settings = json.dumps({"policy": "rkv", "budget": 32, "sink": 24, "window": 8})  # 24 + 8 = the budget
    result = subprocess.run([sys.executable, "-c", "from sglang.srt.plugins import load_plugins\n"
                             "load_plugins()\nprint('decoding without the plugin')"],
                            env={**os.environ, ENV_VAR: settings}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "decoding without the plugin" not in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("sparse-rl-mega's SGLang plugin failed in process")
    assert "PolicyError: budget 32 must exceed sink + window = 32" in result.stderr


SGLANG_INTERNAL = re.compile(r"^\s*(from|import)\s+sglang\.srt\b|[.'\"]_subprocess_watchdog|last_receive_tstamp", re.M)


def test_no_other_module_reaches_into_sglang():
    """``sglang.srt`` imports and SGLang's private attributes appear in sglang_internals.py alone (the
    engine module may use SGLang's public ``sglang.Engine``)."""
    offenders = []
    for folder in ("sparse_rl_mega", "sglang_patches", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "sglang_internals.py" and SGLANG_INTERNAL.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


# ----------------------------------------------------------------------------- what a GPU engine is started with
def _hf_folder(tmp_path) -> str:
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("policy", ["none", "streaming", "snapkv", "rkv", "h2o"])
@pytest.mark.parametrize("override", [False, True])
def test_gpu_engine_arguments(tmp_path, monkeypatch, policy, override):
    """The GPU branch of server_arguments (on_cpu=False), for every KV policy: the pytorch sampling
    backend (its kernels take the request seeds; SGLang would pick flashinfer, which takes none), one
    token per page, no overlap scheduler, CUDA graphs as cuda_graphs_allowed decides, and the side
    buffers taken out of mem_fraction_static from the engine GPU's free memory."""
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings, cuda_graphs_allowed, records_queries
    from sparse_rl_mega.rollout import engine_args

    asked = []
    monkeypatch.setattr(engine_args, "gpu_free_bytes", lambda gpu: asked.append(gpu) or 40 * 2**30)
    params = {"kernel": 3} if policy in ("snapkv", "rkv") else {}
    kv = EngineKVSettings(policy=policy, budget=64, sink=4, window=8, interval=8, params=params,
                          allow_request_override=override)
    lines = []
    kwargs = engine_args.server_arguments(_hf_folder(tmp_path), kv, on_cpu=False, dtype="bfloat16", seed=3, tp_size=1,
                                          mem_fraction_static=0.8, log_level="error", attention_backend=None,
                                          base_gpu_id=2, memory_saver=True, max_total_tokens=None,
                                          max_running_requests=None, prompt_tokens=100, sampling_support=None,
                                          log=lines.append)
    assert kwargs["sampling_backend"] == "pytorch" and kwargs["page_size"] == 1 and kwargs["disable_overlap_schedule"]
    assert "device" not in kwargs and "attention_backend" not in kwargs  # SGLang's default backend on the GPU
    assert kwargs.get("disable_cuda_graph", False) == (not cuda_graphs_allowed(kv)[0])
    assert kwargs["base_gpu_id"] == 2 and kwargs["enable_memory_saver"] and len(lines) == 1
    if records_queries(kv):
        assert asked == [2] and kwargs["mem_fraction_static"] < 0.8 and kwargs["max_running_requests"] > 0
    else:
        assert asked == [] and kwargs["mem_fraction_static"] == 0.8


@pytest.mark.parametrize("backend", [None, "triton"])
def test_a_cpu_engine_on_triton_runs_its_kernels_under_the_interpreter(tmp_path, monkeypatch, backend):
    """On a CPU, ``attention_backend: triton`` starts the engine's processes with ``TRITON_INTERPRET=1``
    (read as SGLang's kernels are decorated, at import) and one KV split; the variable is the caller's
    again afterwards. torch_native (the CPU default) and a GPU engine on triton get neither."""
    import os

    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout import engine_args
    from sparse_rl_mega.rollout.engine_processes import engine_process_env

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(engine_args, "gpu_free_bytes", lambda gpu: 40 * 2**30)
    common = dict(dtype="float32", seed=0, tp_size=1, mem_fraction_static=0.8, log_level="error", base_gpu_id=0,
                  memory_saver=False, max_total_tokens=None, max_running_requests=None, prompt_tokens=10,
                  sampling_support=None, log=lambda line: None)
    cpu = engine_args.server_arguments(_hf_folder(tmp_path), EngineKVSettings(), on_cpu=True,
                                       attention_backend=backend, **common)
    gpu = engine_args.server_arguments(_hf_folder(tmp_path), EngineKVSettings(), on_cpu=False,
                                       attention_backend=backend, **common)
    assert cpu["attention_backend"] == (backend or "torch_native") and gpu.get("attention_backend") == backend
    assert cpu.get("triton_attention_num_kv_splits") == (1 if backend else None)
    assert "triton_attention_num_kv_splits" not in gpu
    with engine_process_env(on_cpu=True, triton_interpreter=cpu["attention_backend"] == "triton"):
        assert os.environ.get("TRITON_INTERPRET") == ("1" if backend else None)
    with engine_process_env(on_cpu=False, triton_interpreter=True):
        assert "TRITON_INTERPRET" not in os.environ
    assert "TRITON_INTERPRET" not in os.environ


def test_the_metadata_check_turns_cuda_graphs_off():
    """A replayed CUDA graph writes its metadata into captured buffers: the check reads eager steps only."""
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings, cuda_graphs_allowed

    assert cuda_graphs_allowed(EngineKVSettings(policy="streaming"))[0]
    assert cuda_graphs_allowed(EngineKVSettings(policy="streaming", check_attention_metadata=True)) == (
        False, "CUDA graphs off: check_attention_metadata reads each step's eager attention metadata")


def test_free_memory_of_another_gpu_opens_no_cuda_context(monkeypatch):
    """A separate engine's GPU is asked through NVML; cudaMemGetInfo (torch.cuda.mem_get_info) would
    open a CUDA context there that the learner rank keeps for its life. Its own GPU: cudaMemGetInfo."""
    import types

    import torch

    from sparse_rl_mega.rollout import engine_args

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda gpu: calls.append(("cuda", gpu)) or (7, 9))
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda gpu: gpu + 10)  # CUDA_VISIBLE_DEVICES order
    nvml = types.SimpleNamespace(nvmlInit=lambda: calls.append("init"),
                                 nvmlDeviceGetHandleByIndex=lambda index: calls.append(("nvml", index)) or index,
                                 nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(free=5, used=1))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert engine_args.gpu_free_bytes(0) == 7 and calls == [("cuda", 0)]
    calls.clear()
    assert engine_args.gpu_free_bytes(3) == 5 and calls == ["init", ("nvml", 13)]


def test_attention_backends_that_sglang_pages_are_refused(monkeypatch):
    """Every attention backend SGLang 0.5.23 accepts either keeps one token per page through SGLang's
    own page-size passes (srt/arg_groups/overrides.py, run here on a Blackwell-like platform, where fa4
    pages) and is accepted, or is refused in one line naming rollout.attention_backend; a scheduler
    that resolved pages, another sampler, overlap or speculation is refused where it is built."""
    import types

    from sglang.srt.arg_groups import overrides
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    from sparse_rl_mega.config import ConfigError, config_from_dict
    from sparse_rl_mega.kv.engine_settings import ATTENTION_BACKENDS, attention_backend_problem, resolved_engine_problem

    monkeypatch.setattr(overrides, "get_platform", lambda: types.SimpleNamespace(is_sm100=True, is_hip=False,
                                                                                 is_musa=False))
    monkeypatch.setattr(overrides, "use_mla_backend", lambda view: False)
    monkeypatch.setattr(overrides, "xpu_has_xmx_support", lambda: True)
    monkeypatch.setattr(overrides, "model_config_of", lambda view: types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLM"])))
    passes = [overrides._mla_backend_page_constraints, overrides._fa4_page_constraint,
              overrides._intel_xpu_page_constraint]
    paged = set()
    for backend in ATTENTION_BACKEND_CHOICES:
        view = types.SimpleNamespace(page_size=1, attention_backend=backend, decode_attention_backend=None,
                                     prefill_attention_backend=None, speculative_draft_attention_backend=None,
                                     speculative_eagle_topk=None, device="cuda")
        if any(p(view).get("page_size", 1) != 1 for p in passes):
            paged.add(backend)
    assert {"trtllm_mha", "fa4", "flashmla", "hpc_ops", "intel_xpu"} <= paged  # the reading, still true
    assert not paged & set(ATTENTION_BACKENDS)
    assert set(ATTENTION_BACKENDS) <= set(ATTENTION_BACKEND_CHOICES)
    for backend in ATTENTION_BACKEND_CHOICES:
        assert (attention_backend_problem(backend) is None) == (backend in ATTENTION_BACKENDS), backend
    with pytest.raises(ConfigError) as info:
        config_from_dict({"model": {"path": "m", "arch": {}}, "data": {"train_path": "t"},
                          "rollout": {"attention_backend": "trtllm_mha"}})
    assert "\n" not in str(info.value) and "rollout.attention_backend" in str(info.value)
    good = {"page_size": 1, "attention_backends": ("fa3", "fa3"), "sampling_backend": "pytorch", "overlap": False,
            "speculative": None}
    assert resolved_engine_problem(good) is None
    for change, said in [({"page_size": 64}, "pages of 64 tokens"), ({"attention_backends": ("fa3", "fa4")}, "'fa4'"),
                         ({"sampling_backend": "flashinfer"}, "ignores request seeds"),
                         ({"overlap": True}, "overlap scheduler"), ({"speculative": "EAGLE"}, "speculative")]:
        assert said in resolved_engine_problem({**good, **change}), change
