"""Shared fixtures. Heavy components are started once per test session:

* ``tiny_model_dir``: a tiny Llama folder built locally (tokenizer + warm-started weights);
* ``evicting_engine``: one real SGLang engine with StreamingLLM eviction and SGLang's strict idle
  memory-leak check switched on; shut down when its test module ends;
* ``tests/plugins``: a KV policy of another package (``keynorm``, registered by its entry point);
* ``e2e_run``: one ``torchrun --nproc-per-node 2`` launch of the training loop (PP=2) whose MLflow
  store the end-to-end tests read.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a KV policy installed as a user's package would be (tests/plugins: its module and entry point), seen by
# every process of the session: this one, torchrun's ranks, SGLang's schedulers
PLUGINS = ROOT / "tests" / "plugins"
os.environ["PYTHONPATH"] = os.pathsep.join([str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])])
sys.path.insert(0, str(PLUGINS))
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
# SGLang checks for leaked KV slots whenever its scheduler goes idle and crashes if any are lost.
os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"

TRAIN_DATA = ROOT / "examples" / "data" / "arith_sums.jsonl"
E2E_EVAL_ROWS, E2E_EVAL_MAX_NEW = 12, 16
ENGINE_KV = dict(policy="streaming", budget=12, sink=2, window=4, interval=2)


@pytest.fixture(scope="session")
def tiny_arch():
    from sparse_rl_mega.config import ArchConfig

    return ArchConfig(family="llama", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_query_groups=2, vocab_size=384, max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_arch):
    import torch

    from sparse_rl_mega.config import TinyModelConfig
    from sparse_rl_mega.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    return build_tiny_model(out, tiny_arch, TinyModelConfig(tokenizer_vocab_size=384, warmup_sft_steps=60),
                            str(TRAIN_DATA), log=lambda *_: None)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def evicting_engine(tiny_model_dir):
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    engine = RolloutEngine(str(tiny_model_dir), EngineKVSettings(**ENGINE_KV, allow_request_override=True), seed=0,
                           max_total_tokens=2048, max_running_requests=16,
                           support_top_k=-1)  # (reports supports of any truncation: up to the vocabulary)
    yield engine
    engine.shutdown()


def run_captured(command: list, timeout: int, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run ``command`` from the repo root, output captured, in its own session: on timeout the whole
    process tree (torchrun workers, SGLang schedulers) is killed, not only the first process. ``env``:
    variables added to this process's environment."""
    import signal

    with subprocess.Popen([str(c) for c in command], cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\n[test] killed after {timeout} s"
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


_tool_server = None  # this worker's (tests/helpers/tool_server.py), started at its first run


def tool_server():
    """This worker's tool server (tests/helpers/tool_server.py), started at the first call."""
    import atexit
    import shutil
    import tempfile

    from tests.helpers.tool_server import ToolServer

    global _tool_server
    if _tool_server is None:
        folder = Path(tempfile.mkdtemp(prefix="tool-server-"))
        atexit.register(shutil.rmtree, folder, True)
        _tool_server = ToolServer(folder)
    return _tool_server


def run_tool(script: Path, *args, timeout: int = 600, env: Optional[dict] = None, start: bool = True
             ) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` from the repo root (output captured, its process group killed on timeout) as
    a fork of this worker's tool server, which imported torch, Megatron-Core, SGLang and MLflow once,
    under the worker's environment as the server started plus ``env`` (tests/helpers/tool_server.py); as
    a fresh interpreter (:func:`run_captured`) where ``env`` sets a variable that modules may read as they
    are imported, or where the server is not running and not ``start`` (quick runs of the ``unit`` tier,
    which would not repay its start alone)."""
    if (_tool_server is None and not start) or not tool_server().can_run(env or {}):
        return run_captured([sys.executable, script, *args], timeout, env)
    return tool_server().run(script, list(args), env or {}, timeout)


def run_torchrun(script: Path, *args, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a helper script under torchrun on loopback with a free port (output captured), its ranks
    forked from a process that imported the learner once (tests/helpers/torchrun_forked.py). On a CUDA
    machine the ranks are exec'd by torchrun itself, as a GPU launch's are (a fork must not inherit a
    CUDA context, and the fork server's preload imports SGLang, which a GPU check machine may lack)."""
    import torch

    if torch.cuda.is_available():
        return run_captured([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                             script, *args], timeout)
    return run_tool(ROOT / "tests" / "helpers" / "torchrun_forked.py", nproc, script, *args, timeout=timeout)


def run_launch(config: Path, *overrides: str, timeout: int = 900, env: Optional[dict] = None, fresh: bool = False
               ) -> subprocess.CompletedProcess:
    """``python tools/launch.py CONFIG [--set ...]`` (output captured): with ``fresh`` in a new
    interpreter, as a user runs it; else forked from the tool server (:func:`run_tool`)."""
    if fresh:
        return run_captured([sys.executable, ROOT / "tools" / "launch.py", config, *overrides], timeout, env)
    return run_tool(ROOT / "tools" / "launch.py", config, *overrides, timeout=timeout, env=env)


# the test launches' automatic KV budget: from 12, up 6 whenever more than 1 % of the response tokens have
# rho < 0.9 (the tiny model's 1 % quantile of log rho is -0.8 to -4 at budget 12), else down 2
AUTO_BUDGET = "{min: 8, max: 20, quantile: 1, min_rho: 0.9, increase: 6, decrease: 2}"


def write_test_config(path: Path, model_dir: Path, run_dir: Path, extra: str = "") -> Path:
    path.write_text(f"""
model:
  path: {model_dir}
  arch: {{family: llama, num_layers: 4, hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 4,
         num_query_groups: 2, vocab_size: 384, max_position_embeddings: 512}}
parallel: {{nproc_per_node: 2, tensor_model_parallel_size: 1, pipeline_model_parallel_size: 2}}
rollout:
  n_samples_per_prompt: 4
  max_new_tokens: 24
  max_total_tokens: 2048
  max_running_requests: 16
  kv_compression: {{policy: rkv, budget: 12, sink: 2, window: 4, interval: 2, params: {{kernel: 3}},
                   auto_budget: {AUTO_BUDGET}}}
data: {{train_path: {TRAIN_DATA}, prompts_per_iteration: 4}}
trainer: {{iterations: 3, global_batch_size: 8, micro_batch_size: 2, lr: 1.0e-3, weight_decay: 0.0, run_dir: {run_dir}}}
algorithm: {{kl_coef: 0.01, entropy_coef: 0.001, dual_clip: 3.0, correction: {{preset: sparse_rl}}}}
tracking: {{experiment: e2e-test}}
checkpoint: {{save_interval: 1, keep_last: 2}}
{extra}
""")
    return path


@pytest.fixture(scope="session")
def e2e_run(tmp_path_factory, tiny_model_dir):
    """One real training launch: returns (run_dir, completed process)."""
    work = tmp_path_factory.mktemp("e2e")
    run_dir = work / "run"
    held_out = work / "held_out.jsonl"
    held_out.write_text("".join(TRAIN_DATA.read_text().splitlines(keepends=True)[:E2E_EVAL_ROWS]))
    # greedy held-out evaluation before training, after iteration 2 and after the last (3)
    extra = (f"eval: {{path: {held_out}, kv: 'dense,rollout', n_samples: 1, temperature: 0.0, interval: 2, "
             f"max_new_tokens: {E2E_EVAL_MAX_NEW}}}")
    config = write_test_config(work / "e2e.yaml", tiny_model_dir, run_dir, extra)
    proc = run_launch(config, fresh=True)  # the suite's launch that starts as a user's does, in a new interpreter
    return run_dir, proc


def alive(pids) -> list[int]:
    """Those of ``pids`` whose process still runs (a zombie has ended: its parent has not reaped it yet)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def greedy_correct(model, tokenizer, rows: list[dict], max_new_tokens: int) -> list[float]:
    """transformers' greedy decoding of each row's prompt, scored against its label (exact answer)."""
    import torch

    from sparse_rl_mega.reward.exact import exact_answer_reward

    out = []
    for row in rows:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id or 0)
        out.append(exact_answer_reward(tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True),
                                       row["label"]))
    return out


# the modules that read the shared ``e2e_run``: one xdist worker runs them all, so the launch runs once
E2E_READERS = ("tests/test_e2e.py", "tests/test_resume.py", "tests/test_multinode.py", "tests/test_export_hf.py")
# handed out first, longest first (pytest.ini: --no-loadscope-reorder keeps this order), so that no long
# module starts last on its own; the rest follow in file order
LONGEST = E2E_READERS + ("tests/test_ablation.py", "tests/test_overlap.py", "tests/test_learner.py", "tests/test_layout_invariance.py",
                         "tests/test_evaluate.py", "tests/test_tools.py", "tests/test_engine_kv.py", "tests/test_planner.py",
                         "tests/test_engine_retraction.py")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# Test tiers (markers, pytest.ini), for the edit-test loop: ``make test-fast`` runs ``unit`` alone.
#   unit    pure modules and pure tests (no SGLang engine, no torchrun): under a minute in all
#   engine  starts a real SGLang engine in the test process
#   launch  runs torchrun sessions or whole training launches (tools/launch.py and the tools around it)
# A module's tier comes from this table; a pure test in a heavier module carries @pytest.mark.unit.
UNIT_MODULES = ("test_config", "test_context_parallel", "test_correction", "test_cpu_shims", "test_data_math",
                "test_data_reward", "test_gpu", "test_hf_map", "test_kv_policies", "test_math_reward",
                "test_scale_config", "test_tracking", "test_preflight", "test_console", "test_checkpoint_files",
                "test_watchdog", "test_weight_push", "test_sglang_internals", "test_auto_budget", "test_layers")
ENGINE_MODULES = ("test_engine_kv", "test_engine_retraction", "test_evaluate")
TIERS = ("unit", "engine", "launch")


def _tier(module: str) -> str:
    name = Path(module).stem
    return "unit" if name in UNIT_MODULES else "engine" if name in ENGINE_MODULES else "launch"


@pytest.hookimpl(optionalhook=True)  # a pytest without xdist (e.g. tools/gpu_check.sh) ignores it
def pytest_xdist_make_scheduler(config, log):
    """Two pytest-xdist workers (pytest.ini: ``-n 2``) share the suite by module, so a module's engine
    or torchrun session starts once; the readers of ``e2e_run`` form one unit. Units are handed out in
    collection order, which ``pytest_collection_modifyitems`` sorts longest first (``LONGEST``)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "e2e_run" if module in E2E_READERS else module

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = _module(item.nodeid)
        if "e2e_run" in getattr(item, "fixturenames", ()) and module not in E2E_READERS:
            raise pytest.UsageError(f"{module} reads e2e_run: add it to E2E_READERS in tests/conftest.py")

        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(_tier(module))

    def rank(item) -> int:
        module = _module(item.nodeid)
        return LONGEST.index(module) if module in LONGEST else len(LONGEST)

    items.sort(key=rank)  # stable: test order within a module kept
