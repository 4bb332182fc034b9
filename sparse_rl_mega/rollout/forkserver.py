"""CPU engines start their scheduler and detokenizer processes from a forkserver that has already
imported SGLang.

SGLang starts every engine process with ``spawn``: each one imports torch and SGLang from scratch
(~16 CPU-s on these 2-core machines, twice per engine: scheduler and detokenizer, more with TP).
Here the first CPU engine of a process starts multiprocessing's forkserver with those modules
preloaded (one import), and every engine process after that is a fork of it (well under a second).
A fork has the forkserver's memory but not the caller's environment at the time of the start, which
is what ``spawn`` gives and what SGLang's processes read (the KV settings of
``sglang_patches.settings``, thread binding, ``TORCHDYNAMO_DISABLE``): :class:`EngineProcess` carries
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

Only for CPU engines: a forkserver must not hold CUDA state, and GPU engines keep SGLang's ``spawn``.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.context import ForkServerProcess
from typing import Optional

from sglang_patches.settings import ENV_VAR

PRELOAD = ["sparse_rl_mega.rollout.forkserver_preload",  # first: SIGQUIT ignored while SGLang imports
           "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]

_started: dict[int, "EngineProcess"] = {}  # pid -> process, for exit codes
_install_lock = threading.Lock()
_server_thread: Optional[ThreadPoolExecutor] = None  # starts the server; never ends before this process
_server_environment: Optional[dict[str, str]] = None  # what the server imported SGLang under
# read by SGLang's processes only after the fork, and set anew for each engine: the KV settings (by the
# plugin, as it loads), the CPU cores of each TP rank (at thread binding), the engine's run id (by its
# offloader), and pytest's name of the running test
READ_AFTER_FORK = frozenset({ENV_VAR, "SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_RUN_ID", "PYTEST_CURRENT_TEST"})


class EngineProcess(ForkServerProcess):
    """An SGLang process forked from the preloaded server, run with the environment of its ``start``."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()
        _started[self.pid] = self

    def run(self) -> None:
        import setproctitle

        setproctitle.getproctitle()  # (sets it up: it relocates the environment, cannot after a clear())
        os.environ.clear()
        os.environ.update(self._environ)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # the server's SIG_IGN is not this process's
        super().run()


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
    return {k: v for k, v in os.environ.items() if k not in READ_AFTER_FORK}


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
    import sglang.srt.entrypoints.engine as sglang_engine

    global _server_thread
    with _install_lock:
        if not isinstance(sglang_engine.mp, _SGLangMultiprocessing):
            multiprocessing.set_forkserver_preload(PRELOAD)
            _server_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-forkserver")
            sglang_engine.mp = _SGLangMultiprocessing()


def forked(pid: int) -> bool:
    """Whether the engine process ``pid`` was forked from the server (not spawned)."""
    return pid in _started


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
