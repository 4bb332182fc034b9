"""CPU engines start their scheduler and detokenizer processes as children of a warm server that has
imported SGLang (``runtime/warm_fork.py``).

SGLang starts every engine process with ``spawn``: each one imports torch and SGLang from scratch
(~16 CPU-s on these 2-core machines, twice per engine: scheduler and detokenizer, more with TP).
Here they are :class:`EngineProcess` children of this process's warm server (well under a second
each), which behave as SGLang's spawned processes would: they start under the environment of their
start (the KV settings of ``sparse_rl_mega.kv.engine_settings``, thread binding,
``TORCHDYNAMO_DISABLE``). Settings read at import are the server's: an engine started under another
import environment (:func:`runtime.warm_fork.serves`) is spawned instead.

A process that will start CPU engines (a learner rank that hosts one, the evaluation and benchmark
tools) calls :func:`start_server_here` first, while it runs one thread: SGLang's modules are imported
there once, under the environment of the engine processes, and the server is forked from that process.
Otherwise (a test worker) the first engine starts a new-interpreter server that imports them.

A failing SGLang process sends SIGQUIT to its parent, the server, which ignores it: one engine's failure
does not end the server and, through the children's parent-death signal, the other engines of this
process. Their exit codes come through the server (:func:`exit_code`): they are not this process's
children.

Engine processes freeze the server's heap (``gc.freeze``) before SGLang runs: its CPU ``empty_cache``
is a full garbage collection, at every cache flush, idle sleep and weight reload.

Only for CPU engines: a server must not hold CUDA state, and GPU engines keep SGLang's ``spawn``.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing
import signal
import threading
from typing import Optional

from sparse_rl_mega.kv.engine_settings import ENV_VAR
from sparse_rl_mega.rollout import sglang_internals
from sparse_rl_mega.runtime import warm_fork
from sparse_rl_mega.runtime.warm_fork import WarmProcess

_started: dict[int, EngineProcess] = {}  # pid -> process, for exit codes
_spawned_because: list[str] = []  # the variables that sent the last engine process to spawn
_install_lock = threading.Lock()
# read by SGLang's processes only after the fork, and set anew for each engine: the KV settings (by the
# plugin, as it loads), the CPU cores of each TP rank (at thread binding), the engine's run id (by its
# offloader)
READ_AFTER_FORK = frozenset({ENV_VAR, "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_RUN_ID"})
# set in this process between an early server's imports and an engine's start, by SGLang's engine as
# it starts (``_set_envs_and_config``, ``handle_environment_variables``) or by the learner; none is read
# as a module is imported on the CPU (only by GPU or grammar code, or after the fork):
SET_AFTER_PRELOAD = frozenset({
    # NCCL, CUDA and GPU-kernel settings
    "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_MNNVL_ENABLE", "NCCL_GRAPH_MIXING_SUPPORT",
    "CUDA_DEVICE_MAX_CONNECTIONS", "TRTLLM_ENABLE_PDL", "CUTE_DSL_LOG_LEVEL", "CUTE_DSL_LOG_TO_CONSOLE",
    "SGLANG_USE_CUDA_IPC_TRANSPORT",
    # from SGLang's arguments: read at import only by FlashInfer's backends (GPU) and outlines'
    # jump-forward map (grammar-constrained decoding, which no engine here uses); else when called
    "SGLANG_ENABLE_TORCH_COMPILE", "SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "SGLANG_DISABLE_OUTLINES_DISK_CACHE",
    # the learner's: Megatron's attention backend for Transformer Engine, MLflow's store (its
    # ``set_tracking_uri``) and telemetry session (set as its client starts, unless
    # MLFLOW_DISABLE_TELEMETRY), which no engine process imports; the tracker's telemetry opt-outs
    # (``tracking.py``: set while a background engine start launches its processes, they made its
    # detokenizer a spawned interpreter whenever the launching shell had not exported them) and its
    # bounds on one HTTP request to a tracking server, read by MLflow's client at each request (set
    # after the engine started, they made an engine restarted later a spawned one)
    "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "MLFLOW_TRACKING_URI", "_MLFLOW_TELEMETRY_SESSION_ID",
    "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_TIMEOUT"})
# set by SGLang's modules as they are imported (its cache folders under the user's cache, log levels), the same
# values each time: a process that imported SGLang itself (an engine run in a test worker) still imports as
# the server did
SET_BY_SGLANG_IMPORT = frozenset({"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "TILELANG_CACHE_DIR",
                                  "FLASHINFER_WORKSPACE_BASE", "DG_JIT_CACHE_DIR", "DG_JIT_USE_NVRTC", "TLLM_LOG_LEVEL"})
warm_fork.read_after_start(*READ_AFTER_FORK, *SET_AFTER_PRELOAD, *SET_BY_SGLANG_IMPORT)


class EngineProcess(WarmProcess):
    """An SGLang process: a child of the warm server, started as SGLang's spawned processes are."""

    def start(self) -> None:
        super().start()
        _started[self.pid] = self

    def prepare(self) -> None:
        # The server's preloaded modules (torch, SGLang: ~680k objects) live as long as the process:
        # frozen, a garbage collection skips them. SGLang's CPU ``empty_cache`` is a gc.collect() (at
        # every cache flush, idle sleep and weight reload; again as the KV pool is sized), ~0.4 s each
        # over the whole heap; ~3 of an engine's ~9 CPU-s in a 3-iteration launch of the test config.
        gc.freeze()
        _tqdm_lock_without_tracker()
        # a Ctrl-C reaches the whole terminal's process group: an engine process ends with its owner
        # (shut down, or its parent-death signal), not with a KeyboardInterrupt traceback of its own
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _tqdm_lock_without_tracker() -> None:
    """tqdm's lock across processes (for SGLang's progress bars), made as a fork-context semaphore,
    which is unlinked at once: one made under SGLang's ``spawn`` default stays registered with the
    resource tracker until it is freed, and an engine process killed at shutdown (CPU engines end so)
    would leave it in /dev/shm, or have the tracker report it leaked as the job ends."""
    from tqdm.std import TqdmDefaultWriteLock

    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = multiprocessing.get_context("fork").RLock()


class _SGLangMultiprocessing:
    """``multiprocessing`` as SGLang's engine module sees it: its ``Process`` is :class:`EngineProcess`
    under the server's environment, else multiprocessing's own (``spawn``, which SGLang sets)."""

    @property
    def Process(self):  # (multiprocessing's name)
        return EngineProcess if _server_for_this_environment() else multiprocessing.Process

    def __getattr__(self, name: str):
        return getattr(multiprocessing, name)


def _server_for_this_environment() -> bool:
    """Whether a process started now can be a child of the warm server: with none running yet, one is
    started under the first engine's environment as SGLang launches that engine's first process (SGLang
    has set its own variables by then). An import environment other than the server's gets ``spawn``:
    SGLang reads many settings as its modules are imported (e.g. a test's ``SGLANG_TEST_RETRACT``)."""
    serves = warm_fork.start_server(ENGINE_PROCESS_PRELOAD)  # (one that runs already stays)
    _spawned_because[:] = [] if serves else warm_fork.differences()
    return serves


def use_forkserver() -> None:
    """Make SGLang's engine module start engine processes through :class:`_SGLangMultiprocessing`
    (idempotent; CPU engines only)."""
    with _install_lock:
        if not isinstance(sglang_internals.engine_multiprocessing(), _SGLangMultiprocessing):
            sglang_internals.set_engine_multiprocessing(_SGLangMultiprocessing())


ENGINE_PROCESS_PRELOAD = [sglang_internals.ENGINE_MODULE, *sglang_internals.ENGINE_PROCESS_MODULES]


def import_engine_modules() -> None:
    """SGLang's engine module and the modules of its processes, imported in this process."""
    for name in ENGINE_PROCESS_PRELOAD:
        importlib.import_module(name)


def start_server_here() -> bool:
    """Import SGLang's engine and process modules in this process and make its warm server now: the
    engines' processes then come from a process that has them already (and this one needs them to
    drive its engines). Call it first thing, under the environment of the engine processes
    (``rollout.engine.preload_cpu_engines``), while this process runs one thread (else the server is a
    new interpreter that imports them again). True when the server serves this environment."""
    import_engine_modules()
    return warm_fork.start_server(ENGINE_PROCESS_PRELOAD)


def forked(pid: int) -> bool:
    """Whether the engine process ``pid`` was forked from the server (not spawned)."""
    return pid in _started


def how_started(pids) -> str:
    """How the engine processes ``pids`` started, for the engine's start-up line."""
    if not any(forked(pid) for pid in pids):
        differ = ", ".join(_spawned_because[:5]) + (" ..." if len(_spawned_because) > 5 else "")
        return f"spawned: SGLang imports under other values of {differ} than its warm server" if differ else "spawned"
    return "forked from this process" if warm_fork.how_started() == "forked" else "forked from a preloaded server"


def exit_code(pid: int) -> Optional[int]:
    """The exit code of the forked process ``pid`` (negative: the signal), waiting up to 1 s for the
    server's report; None while it runs."""
    process = _started[pid]
    process.join(timeout=1.0)  # the server reports the code as it reaps the process: at once
    return process.exitcode


def forget(pids) -> None:
    """Drop finished processes from the exit-code table."""
    for pid in pids:
        _started.pop(pid, None)
