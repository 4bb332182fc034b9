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


# what the suite's in-process runs fork from beyond a launcher's ranks (SGLang's modules under the engine
# processes' environment, the ranks' modules: train/forked_ranks.py): torchrun's agent, export's writer,
# the learner helpers' modules and transformers' models they compare against
SUITE_PRELOAD = ("safetensors.torch", "torch.distributed.run", "torch.distributed.launcher.api",
                 "sparse_rl_mega.learner.model", "sparse_rl_mega.learner.step", "sparse_rl_mega.learner.weights",
                 "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                 "transformers.models.qwen3.modeling_qwen3")


def warm_server() -> None:
    """Start this test worker's warm server (runtime/warm_fork.py) once, before its first engine, launch or
    tool run: a new interpreter (the worker runs more than one thread) that imports what they fork."""
    from sparse_rl_mega.runtime import warm_fork
    from sparse_rl_mega.train.forked_ranks import ENGINE_MODULES, RANK_MODULES

    if warm_fork.server_pid() is None:
        warm_fork.start_server([*ENGINE_MODULES, *RANK_MODULES, *SUITE_PRELOAD])


class _Stopped(BaseException):
    """A run in process that outlived its time limit."""


def run_in_process(call, timeout: int, env: Optional[dict] = None, name: str = "run") -> subprocess.CompletedProcess:
    """``call()`` in this process as a fresh interpreter would run it, with its output and that of the
    processes it starts captured (descriptors 1 and 2, ``sys.stdout``/``sys.stderr``), ``env`` added to the
    environment, and afterwards this process's environment, working folder, ``sys.argv``, ``sys.path``,
    signal handlers and warning filters as they were. Its exit code: what it returned, or the code of
    ``SystemExit``, or 1 after a traceback; past ``timeout`` s it is interrupted (SIGALRM) and the code is -9."""
    import signal
    import tempfile
    import traceback
    import warnings

    saved_env, saved_cwd, saved_argv, saved_path = dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path)
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
               signal.SIGCHLD, signal.SIGALRM, signal.SIGPIPE]
    saved_handlers = {signum: signal.getsignal(signum) for signum in signals}
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    note = ""

    def stop(signum, frame):
        raise _Stopped()

    try:
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        os.chdir(ROOT)
        signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        with warnings.catch_warnings():
            try:
                code = call()
            except SystemExit as exit_:
                code = exit_.code
            except _Stopped:
                code, note = -9, f"\n[test] {name} stopped after {timeout} s"
            except Exception:  # noqa: BLE001 (as an interpreter: a traceback, status 1)
                traceback.print_exc()
                code = 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved_streams
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        for signum, handler in saved_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    texts = []
    for captured in (out, err):
        captured.seek(0)
        texts.append(captured.read().decode(errors="replace"))
        captured.close()
    return subprocess.CompletedProcess([name], code, texts[0], texts[1] + note)


def start_script(script: Path, args: list, env: dict, log: Path):
    """``python SCRIPT ARGS`` started in the background, its output to ``log``, in a session of its own:
    a child of this worker's warm server that behaves as that new interpreter would
    (``runtime.warm_fork.WarmProcess``: ``pid``, ``exitcode``, ``join``), in this worker's working folder."""
    from sparse_rl_mega.runtime.warm_fork import Descriptor, WarmProcess, run_script

    warm_server()
    with open(log, "w") as out, open(os.devnull) as nothing:
        process = WarmProcess(target=run_script, args=(str(script), [str(a) for a in args]), env={**os.environ, **env},
                              stdio=(Descriptor(nothing.fileno()), Descriptor(out.fileno()), Descriptor(out.fileno())),
                              new_session=True, name=Path(script).name)
        process.start()
    return process


def run_tool(script: Path, *args, timeout: int = 600, env: Optional[dict] = None, warm: bool = True
             ) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` as its ``main(argv)`` called in this process (:func:`run_in_process`): the
    script's module is run afresh (``runpy``: its own module-level state, as a new interpreter's), the
    processes it starts are children of this worker's warm server (started first unless not ``warm``: a
    run that starts no process). Fresh interpreters are for what is about one (:func:`run_captured`): a
    tool's ``--help``, the end-to-end launch, killed launchers."""
    import runpy

    if warm:
        warm_server()

    def call():
        sys.path.insert(0, str(Path(script).resolve().parent))  # as the interpreter puts the script's folder
        module = runpy.run_path(str(script), run_name=f"tool_{Path(script).stem}")
        return module["main"]([str(a) for a in args])

    return run_in_process(call, timeout, env, f"{Path(script).name} {' '.join(map(str, args))}")


def run_torchrun(script: Path, *args, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` on loopback with a free port (output captured):
    torchrun's agent in this process, its ranks children of this worker's warm server, as
    ``tools/launch.py`` runs a job's (``train/forked_ranks.py``). On a CUDA machine torchrun itself, in a
    new interpreter, exec's them, as a GPU launch's are."""
    import torch

    if torch.cuda.is_available():
        return run_captured([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                             script, *args], timeout)
    from sparse_rl_mega.train.forked_ranks import run_script_ranks, start_rank_server

    warm_server()

    def call():
        # (the modules: the worker's server runs already, with SUITE_PRELOAD: warm_server)
        return run_script_ranks(nproc, str(script), [str(a) for a in args], start_rank_server(()), "torchrun")

    return run_in_process(call, timeout, name=f"torchrun {Path(script).name}")


def run_launch(config: Path, *overrides: str, timeout: int = 900, env: Optional[dict] = None, fresh: bool = False
               ) -> subprocess.CompletedProcess:
    """``python tools/launch.py CONFIG [--set ...]`` (output captured): with ``fresh`` in a new
    interpreter, as a user runs it; else its ``main`` in this process (:func:`run_tool`)."""
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
                         "tests/test_evaluate.py", "tests/test_tools.py", "tests/test_engine_kv.py", "tests/test_engine_triton.py",
                         "tests/test_planner.py",
                         "tests/test_engine_retraction.py")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# Test tiers (markers, pytest.ini), for the edit-test loop: ``make test-fast`` runs ``unit`` alone.
#   unit    pure modules and pure tests (no SGLang engine, no torchrun): under a minute in all
#   engine  starts a real SGLang engine in the test process
#   launch  runs torchrun sessions or whole training launches (tools/launch.py and the tools around it)
# A module's tier comes from this table, where every module must be (a new one is refused at collection,
# rather than landing in the slowest tier unseen); a pure test in a heavier module carries @pytest.mark.unit.
UNIT_MODULES = ("test_config", "test_context_parallel", "test_correction", "test_cpu_shims", "test_data_math",
                "test_data_reward", "test_gpu", "test_hf_map", "test_kv_policies", "test_math_reward",
                "test_scale_config", "test_tracking", "test_preflight", "test_console", "test_checkpoint_files",
                "test_watchdog", "test_weight_push", "test_sglang_internals", "test_auto_budget", "test_layers",
                "test_cadence")
ENGINE_MODULES = ("test_engine_kv", "test_engine_triton", "test_engine_retraction", "test_evaluate")
LAUNCH_MODULES = ("test_ablation", "test_e2e", "test_export_hf", "test_layout_invariance", "test_learner",
                  "test_multinode", "test_overlap", "test_planner", "test_reliability", "test_resume", "test_tools",
                  "test_warm_fork")
TIERS = ("unit", "engine", "launch")


def _tier(module: str) -> str:
    name = Path(module).stem
    for tier, names in zip(TIERS, (UNIT_MODULES, ENGINE_MODULES, LAUNCH_MODULES)):
        if name in names:
            return tier
    if Path(module).parent != Path("tests"):  # (a session over other files with this plugin: test_warm_fork)
        return "launch"
    raise pytest.UsageError(f"{module} is in no test tier: add {name!r} to UNIT_MODULES (no engine, no torchrun), "
                            "ENGINE_MODULES (starts an SGLang engine) or LAUNCH_MODULES (torchrun or launches) in "
                            "tests/conftest.py")


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

        tier = _tier(module)  # (also for a module whose tests all carry a tier of their own)
        if not any(item.get_closest_marker(name) for name in TIERS):
            item.add_marker(tier)

    def rank(item) -> int:
        module = _module(item.nodeid)
        return LONGEST.index(module) if module in LONGEST else len(LONGEST)

    items.sort(key=rank)  # stable: test order within a module kept


# ----------------------------------------------------------------- every process of the session ends with it
# The session's first process (pytest's, or its xdist controller) is the subreaper of everything the session
# starts (PR_SET_CHILD_SUBREAPER): a process whose parent died is re-parented to it, not to init, so it is
# still found among its descendants. Stopped by SIGTERM or SIGHUP (a CI timeout: `timeout` signals the whole
# process group), it ends them all before it exits; Ctrl-C, a failure and a normal end reach
# pytest_unconfigure, which does the same. Each bound: a few seconds.
_PR_SET_CHILD_SUBREAPER = 36
_is_controller = False  # this process is pytest-xdist's controller (its children are the workers)


def _end_descendants(grace_s: float = 0.0) -> list[tuple[str, int]]:
    """SIGKILL every descendant of this process (after ``grace_s`` s for those about to end by
    themselves), multiprocessing's resource trackers last: they unlink the named semaphores
    (/dev/shm/sem.mp-*) of the processes that died once those have gone. Reap the children; ``(name,
    pid)`` of those that were killed."""
    import time

    import psutil

    deadline = time.monotonic() + grace_s
    while True:
        left = [p for p in psutil.Process().children(recursive=True) if alive([p.pid])]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    trackers = [p for p in left if _is_resource_tracker(p)]
    killed = []
    for process in [p for p in left if p not in trackers]:
        try:
            killed.append((process.name(), process.pid))
            process.kill()
        except psutil.Error:  # (ended meanwhile)
            pass
    _let_own_tracker_end()
    deadline = time.monotonic() + 5.0  # (a tracker ends once every process that used it has)
    while alive([p.pid for p in trackers]) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    for process in trackers:
        try:
            if alive([process.pid]):
                killed.append((process.name(), process.pid))
                process.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not _reap() and not alive([p.pid for p in psutil.Process().children(recursive=True)]):
            break
        time.sleep(0.05)
    return killed


def _let_own_tracker_end() -> None:
    """Close this process's end of its own resource tracker's pipe, so that the tracker unlinks what the
    killed processes registered and ends (else it is killed with the rest and their semaphores stay in
    /dev/shm: 9 after a ``-n 0`` run of the killed-launcher test, whose next launch runs in this process)."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    with tracker._lock:
        if tracker._fd is not None:
            os.close(tracker._fd)
            tracker._fd = None


def _reap() -> bool:
    """Reap this process's ended children; whether any is left to wait for."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _is_resource_tracker(process) -> bool:
    import psutil

    try:
        return "multiprocessing.resource_tracker" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def _stopped(signum, frame) -> None:
    import signal

    killed = _end_descendants()
    print(f"\n[tests] stopped by {signal.Signals(signum).name}: ended {len(killed)} process(es) of the session",
          file=sys.__stderr__, flush=True)
    os._exit(128 + signum)


# ----------------------------------------------------------------- nothing of ours left in /dev/shm
# SGLang's load snapshots and TP queues: every engine a test starts and every job a test kills must leave
# none (rollout/shm_record.py). Counted by name: those made during the session and still there at its end
# fail it (this machine's other processes' files are not counted). multiprocessing's named semaphores
# (sem.mp-*) are unlinked by its resource trackers once their processes are gone, which the session's
# end does last (pytest_unconfigure): any still there after that are named.
SGLANG_SHM, MULTIPROCESSING_SHM = ("sglang_loads_", "sgl_shm_"), ("sem.mp-",)
_shm_at_start: set[str] = set()


def _shm_files(families: tuple[str, ...]) -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(families)} \
        if os.path.isdir("/dev/shm") else set()


def _shm_left(families: tuple[str, ...]) -> Optional[str]:
    left = sorted(_shm_files(families) - _shm_at_start)
    return f"\n[tests] {len(left)} file(s) made during the session are left in /dev/shm: {', '.join(left[:10])}" \
        if left else None


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    line = _shm_left(SGLANG_SHM)
    if line:
        print(line, file=sys.__stderr__, flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    import ctypes
    import signal

    if hasattr(config, "workerinput"):  # (an xdist worker: the controller is the subreaper)
        return
    _shm_at_start.update(_shm_files(SGLANG_SHM + MULTIPROCESSING_SHM))
    global _is_controller
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _is_controller = bool(getattr(config.option, "numprocesses", None))
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stopped)


def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):
        return
    infrastructure = {_warm_server_pid(), *_resource_trackers()}  # (this process's own: they end with it)
    killed = [f"{name} ({pid})" for name, pid in _end_descendants(grace_s=2.0) if pid not in infrastructure]
    if killed:
        print(f"\n[tests] ended {len(killed)} process(es) that outlived their tests: {', '.join(killed[:20])}",
              file=sys.__stderr__, flush=True)
    line = _shm_left(MULTIPROCESSING_SHM)
    if line:
        print(line, file=sys.__stderr__, flush=True)


def _warm_server_pid() -> Optional[int]:
    """This process's warm server (without ``-n``, the session's process runs the tests)."""
    warm_fork = sys.modules.get("sparse_rl_mega.runtime.warm_fork")
    return warm_fork.server_pid() if warm_fork else None


def _resource_trackers() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children() if _is_resource_tracker(p)]


@pytest.fixture(autouse=True)
def _warm_server_first(request):
    """Engine and launch tests start this worker's warm server first (what they fork from), so that how
    fast a test starts its processes does not depend on which test of the worker ran before."""
    if request.node.get_closest_marker("engine") or request.node.get_closest_marker("launch"):
        warm_server()
    yield


def pytest_runtest_logreport(report):
    """(The xdist controller, as each report comes) reap the orphans re-parented to it that have ended:
    its own children are the workers, which end only after the last report."""
    import psutil

    if report.when != "teardown" or os.environ.get("PYTEST_XDIST_WORKER") or not _is_controller:
        return
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass
