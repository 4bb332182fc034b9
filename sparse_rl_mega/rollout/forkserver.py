"""CPU engines start their scheduler and detokenizer processes from a forkserver that has already
imported SGLang.

SGLang starts every engine process with ``spawn``: each one imports torch and SGLang from scratch
(~16 CPU-s on these 2-core machines, twice per engine: scheduler and detokenizer, more with TP).
Here the first CPU engine of a process starts multiprocessing's forkserver with those modules
preloaded (one import), and every engine process after that is a fork of it (well under a second).
A fork has the forkserver's memory but not the caller's environment at the time of the start, which
is what ``spawn`` gives and what SGLang's processes read (the KV settings of
``sparse_rl_mega.kv.engine_settings``, thread binding, ``TORCHDYNAMO_DISABLE``): :class:`EngineProcess` carries
that environment across and installs it before the process's target runs. Settings read at import
are the server's: it is started under the first engine's environment, and an engine started under
another one (apart from variables read after the fork) is spawned instead.

The forkserver is a child of this process and asks for SIGKILL when it ends (``PR_SET_PDEATHSIG``,
however it ends: its pipe would not tell, SGLang's processes hold it open too); SGLang's processes
ask the same of the server, so none outlives the job. A failing SGLang process sends SIGQUIT to its
parent, which here is the forkserver: it ignores SIGQUIT
(:mod:`sparse_rl_mega.rollout.forkserver_preload`), so one engine's failure does not end the server
and, through ``PR_SET_PDEATHSIG``, the other engines of this process. Their exit codes come through
the server (:func:`exit_code`): they are not this process's children.

A process that will start CPU engines (a learner rank that hosts one, the evaluation and benchmark
tools) calls :func:`start_server_here` first, while it runs one thread: SGLang's modules are imported
there once, under the environment of the engine processes, and the server is a fork of that process
(``sparse_rl_mega/runtime/process_server.py``; multiprocessing's own server is a new interpreter that imports
them all again: ~15 CPU-s more per host). A process with other threads running (a test worker) gets
multiprocessing's server at its first engine as before: a fork keeps only the calling thread, and
locks the others hold would stay locked.

Engine processes freeze the server's heap (``gc.freeze``) before SGLang runs: its CPU ``empty_cache``
is a full garbage collection, at every cache flush, idle sleep and weight reload.

Only for CPU engines: a forkserver must not hold CUDA state, and GPU engines keep SGLang's ``spawn``.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.context import ForkServerProcess
from typing import Optional

from sparse_rl_mega.kv.engine_settings import ENV_VAR
from sparse_rl_mega.rollout import sglang_internals
from sparse_rl_mega.runtime import process_server
from sparse_rl_mega.runtime.jobs import die_with_parent

PRELOAD = ["sparse_rl_mega.rollout.forkserver_preload",  # first: SIGQUIT ignored while SGLang imports
           *sglang_internals.ENGINE_PROCESS_MODULES]

_started: dict[int, "EngineProcess"] = {}  # pid -> process, for exit codes
_install_lock = threading.Lock()
_server_thread: Optional[ThreadPoolExecutor] = None  # starts the server; never ends before this process
_server_environment: Optional[dict[str, str]] = None  # what the server imported SGLang under
_forked_server_pid: Optional[int] = None  # the server forked from this process (start_server_here)
# read by SGLang's processes only after the fork, and set anew for each engine: the KV settings (by the
# plugin, as it loads), the CPU cores of each TP rank (at thread binding), the engine's run id (by its
# offloader), and pytest's name of the running test
READ_AFTER_FORK = frozenset({ENV_VAR, "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_RUN_ID", "PYTEST_CURRENT_TEST"})
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


class EngineProcess(ForkServerProcess):
    """An SGLang process forked from the preloaded server, run with the environment of its ``start``."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()
        _started[self.pid] = self

    def run(self) -> None:
        # SIGKILL when the server ends, from the first instruction: SGLang asks for it only once set up, and a
        # job stopped while its engine starts would leave the processes forked before then running
        die_with_parent()
        process_server.take_environment(self._environ)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # the server's SIG_IGN is not this process's
        # The server's preloaded modules (torch, SGLang: ~680k objects) live as long as the process:
        # frozen, a garbage collection skips them. SGLang's CPU ``empty_cache`` is a gc.collect() (at
        # every cache flush, idle sleep and weight reload; again as the KV pool is sized), ~0.4 s each
        # over the whole heap; ~3 of an engine's ~9 CPU-s in a 3-iteration launch of the test config.
        gc.freeze()
        _tqdm_lock_without_tracker()
        super().run()


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
    def Process(self):  # noqa: N802 (multiprocessing's name)
        return EngineProcess if _server_for_this_environment() else multiprocessing.Process

    def __getattr__(self, name: str):
        return getattr(multiprocessing, name)


def _import_environment() -> dict[str, str]:
    """The environment that modules may read as they are imported: all of it but the variables read
    only after the fork (:data:`READ_AFTER_FORK`)."""
    return {k: v for k, v in os.environ.items() if k not in READ_AFTER_FORK and k not in SET_AFTER_PRELOAD}


def _server_for_this_environment() -> bool:
    """Whether a process started now can be forked: the server is started under the first engine's
    environment as SGLang launches that engine's first process (SGLang has set its own variables by
    then), from a thread of its own that lives as long as this process (the server asks for SIGKILL
    when the thread that started it ends, so it must not be an engine's start thread). An environment
    other than the server's gets ``spawn``: SGLang reads many settings as its modules are imported (e.g.
    a test's ``SGLANG_TEST_RETRACT``), and the server imported them under its own."""
    global _server_environment
    environment = _import_environment()
    with _install_lock:
        if _server_environment is None:
            _server_environment = environment
        if environment != _server_environment:
            return False
    _server_thread.submit(multiprocessing.forkserver.ensure_running).result()  # (again if it died)
    return True


def use_forkserver() -> None:
    """Make SGLang's engine module start engine processes through :class:`_SGLangMultiprocessing`
    (idempotent; CPU engines only)."""
    global _server_thread
    with _install_lock:
        if not isinstance(sglang_internals.engine_multiprocessing(), _SGLangMultiprocessing):
            multiprocessing.set_forkserver_preload(PRELOAD)
            _server_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-forkserver")
            sglang_internals.set_engine_multiprocessing(_SGLangMultiprocessing())


def import_engine_modules() -> None:
    """SGLang's engine module and the modules of its processes, imported in this process."""
    for name in [sglang_internals.ENGINE_MODULE, *PRELOAD[1:]]:
        importlib.import_module(name)


def start_server_here() -> bool:
    """Import SGLang's engine and process modules in this process and fork the server from it now:
    the engines' processes then come from a process that has them already (and this one needs them to
    drive its engines). Call it first thing, under the environment of the engine processes
    (``rollout.engine.preload_cpu_engines``). False, with the modules imported but no server, when
    other threads run here (a fork keeps only the calling thread: locks they hold would stay locked
    in the server) or a server runs already; the first engine then starts multiprocessing's."""
    global _server_environment, _forked_server_pid
    import_engine_modules()
    if not process_server.can_fork_server():
        return False
    _forked_server_pid = process_server.fork_server(setup=_ignore_sigquit)
    _server_environment = _import_environment()
    return True


def _ignore_sigquit() -> None:
    """(In the server) as ``forkserver_preload`` does in multiprocessing's: a failing SGLang process
    sends SIGQUIT to its parent, the server."""
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def forked(pid: int) -> bool:
    """Whether the engine process ``pid`` was forked from the server (not spawned)."""
    return pid in _started


def how_started(pids) -> str:
    """How the engine processes ``pids`` started, for the engine's start-up line."""
    if not any(forked(pid) for pid in pids):
        return "spawned"
    if multiprocessing.forkserver._forkserver._forkserver_pid == _forked_server_pid:
        return "forked from this process"
    return "forked from a preloaded server"


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
