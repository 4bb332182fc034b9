"""CPU engines start their scheduler and detokenizer processes from a forkserver that has already
imported SGLang.

SGLang starts every engine process with ``spawn``: each one imports torch and SGLang from scratch
(~16 CPU-s on these 2-core machines, twice per engine: scheduler and detokenizer, more with TP).
Here the first CPU engine of a process starts multiprocessing's forkserver with those modules
preloaded (one import), and every engine process after that is a fork of it (well under a second).
A fork has the forkserver's memory but not the caller's environment at the time of the start, which
is what ``spawn`` gives and what SGLang's processes read (the KV settings of
``sglang_patches.settings``, thread binding, ``TORCHDYNAMO_DISABLE``): :class:`EngineProcess` carries
that environment across and installs it before the process's target runs. Import-time settings are
the forkserver's: it is started under the same environment (``RolloutEngine`` starts it inside
``_engine_process_env``).

The forkserver is a child of this process and asks for SIGKILL when it ends (``PR_SET_PDEATHSIG``,
however it ends: its pipe would not tell, SGLang's processes hold it open too); SGLang's processes
ask the same of the server, so none outlives the job. A failing SGLang process sends SIGQUIT to its parent, which here is the forkserver: it ignores
SIGQUIT (:mod:`sparse_rl_mega.rollout.forkserver_preload`), so one engine's failure does not end the
server and, through ``PR_SET_PDEATHSIG``, the other engines of this process. Their exit codes come
through the server (:func:`exit_description`): they are not this process's children.

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

PRELOAD = ["sparse_rl_mega.rollout.forkserver_preload",  # first: SIGQUIT ignored while SGLang imports
           "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]

_started: dict[int, "EngineProcess"] = {}  # pid -> process, for exit codes
_install_lock = threading.Lock()
_server_thread: Optional[ThreadPoolExecutor] = None  # starts the server; never ends before this process


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
    """``multiprocessing`` as SGLang's engine module sees it: its ``Process`` is :class:`EngineProcess`."""
    Process = EngineProcess

    def __getattr__(self, name: str):
        return getattr(multiprocessing, name)


def use_forkserver() -> None:
    """Make SGLang's engine module start its processes as :class:`EngineProcess` (idempotent; CPU
    only), and the server run: started under the caller's environment, from a thread of its own that
    lives as long as this process (the server asks for SIGKILL when the thread that started it ends, so
    it must not be an engine's start thread)."""
    import sglang.srt.entrypoints.engine as sglang_engine

    global _server_thread
    with _install_lock:
        if not isinstance(sglang_engine.mp, _SGLangMultiprocessing):
            multiprocessing.set_forkserver_preload(PRELOAD)
            sglang_engine.mp = _SGLangMultiprocessing()
        if _server_thread is None:
            _server_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-forkserver")
    _server_thread.submit(multiprocessing.forkserver.ensure_running).result()  # (again if it died)


def exit_description(pid: int) -> Optional[str]:
    """`` (killed by signal 9, SIGKILL)`` or `` (exit status 1)`` for a dead :class:`EngineProcess`
    (waits up to 1 s for the server's report), ``""`` while it runs; None for a pid not started here."""
    process = _started.get(pid)
    if process is None:
        return None
    process.join(timeout=1.0)  # the server reports the code as it reaps the process: at once
    code = process.exitcode
    if code is None:
        return ""
    if code < 0:
        return f" (killed by signal {-code}, {signal.Signals(-code).name})"
    return f" (exit status {code})"


def forget(pids) -> None:
    """Drop finished processes from the exit-code table."""
    for pid in pids:
        _started.pop(pid, None)
