"""The processes of an SGLang engine seen from the process that starts it: the environment they start
under (no launcher variables, their own event loop), SGLang imported once and its processes forked on
CPU, TP ranks' core groups, children that crash without taking this process down, and how an ended
child is described (its name, exit code or signal)."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
from contextlib import contextmanager
from typing import Optional
from collections.abc import Sequence

import torch

from sparse_rl_mega.rollout import forkserver
from sparse_rl_mega.runtime import warm_fork


def keep_process_on_child_crash() -> None:
    """SGLang's scheduler and detokenizer (and its subprocess watchdog) send SIGQUIT to the engine's
    host process when they fail; SGLang's handler then kills this whole process tree, and without a
    handler (an engine started off the main thread) SIGQUIT's default action ends the process. Either
    way a learner rank would die with its engine. Here the engine's calls notice the dead process
    instead and raise :class:`EngineFailure`. Needs the main thread (signal handlers are set there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGQUIT, _child_crashed)


def _child_crashed(signum, frame) -> None:  # (the engine's calls report the failure)
    pass

_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "GROUP_WORLD_SIZE", "ROLE_NAME",
                 "CUDA_DEVICE_MAX_CONNECTIONS")  # the learner's setting (run_training), not the engine's
# what the engine processes' environment changes from their host's (engine_process_env): the warm server
# imported SGLang under theirs already (import_cpu_engine_modules), a host compares the rest
warm_fork.read_after_start("TORCHDYNAMO_DISABLE", *_LAUNCHER_ENV)


@contextmanager
def own_event_loop():
    """A new event loop, current on this thread while SGLang's Engine is built (the Engine keeps the
    thread's current loop): engines built on one thread would otherwise share one loop, and closing one
    engine's loop at its shutdown would break the next."""
    policy = asyncio.get_event_loop_policy()
    try:
        previous = policy.get_event_loop()
    except RuntimeError:  # none on this (non-main) thread
        previous = None
    policy.set_event_loop(policy.new_event_loop())
    try:
        yield
    finally:
        policy.set_event_loop(previous)


@contextmanager
def without_launcher_env():
    saved = {k: os.environ.pop(k) for k in _LAUNCHER_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextmanager
def engine_process_env(on_cpu: bool, triton_interpreter: bool = False):
    """The environment SGLang's processes are spawned with: without the launcher's variables, and on the
    CPU with ``TORCHDYNAMO_DISABLE=1``. SGLang wraps its seeded sampling (``multinomial_with_seed``) in
    ``torch.compile``; on the CPU every new scheduler process then spends ~13 s (2 cores) tracing and
    loading inductor's C++ kernel on its first seeded request, or compiles it with gcc on a fresh
    machine, for a fused kernel that saves microseconds here. Eagerly it samples the same tokens.
    ``triton_interpreter`` (a CPU engine on SGLang's triton backend): ``TRITON_INTERPRET=1``, read as
    ``@triton.jit`` decorates SGLang's kernels at import, so those processes are spawned, not forked
    from the warm server (``rollout/forkserver.py``)."""
    values = {"TORCHDYNAMO_DISABLE": "1"} if on_cpu else {}
    if on_cpu and triton_interpreter:
        values["TRITON_INTERPRET"] = "1"
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        with without_launcher_env():
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def preload_cpu_engines() -> bool:
    """Called first by a process that will start CPU engines (an engine-hosting learner rank, the
    evaluation and benchmark tools), while it runs one thread: SGLang is imported here under the
    environment of the engine processes and their server is forked from this process
    (:func:`forkserver.start_server_here`; ~15 CPU-s less per host than a server that imports it all
    again). Nothing on a GPU machine (GPU engines are spawned); False when no server was forked."""
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # (as RolloutEngine sets it)
    with engine_process_env(on_cpu=True):
        return forkserver.start_server_here()


def import_cpu_engine_modules() -> None:
    """SGLang's modules imported here under the environment of CPU engine processes, as
    :func:`preload_cpu_engines` imports them (for a process that forks the engine hosts:
    ``forked_ranks.py``)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    with engine_process_env(on_cpu=True):
        forkserver.import_engine_modules()


def cpu_core_groups(parts: int) -> str:
    """SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` for a CPU engine with ``parts`` TP ranks: this process's
    cores split into ``parts`` groups (``"0-7|8-15"``); with fewer cores than ranks, ranks share cores.
    Without it SGLang allows one rank per NUMA node only."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // parts)
    groups = []
    for i in range(parts):
        group = cores[i * per:(i + 1) * per] or [cores[i % len(cores)]]
        groups.append(str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}")
    return "|".join(groups)


def process_names(pids: Sequence[int]) -> dict[int, str]:
    """``{pid: name}`` of an engine's processes (SGLang titles them ``sglang::scheduler`` ...)."""
    import psutil

    names = {}
    for pid in pids:
        try:
            title = psutil.Process(pid).name()
        except psutil.NoSuchProcess:
            title = "engine"
        names[pid] = title.split("::")[-1].split("_TP")[0] or "engine"
    return names


def exit_description(pid: int) -> str:
    """`` (killed by signal 9, SIGKILL)`` or `` (exit status 1)`` for a dead engine process, else ``""``
    (still running, or its code unknown)."""
    code = forkserver.exit_code(pid) if forkserver.forked(pid) else _reap_child(pid)
    if code is None:
        return ""
    if code < 0:
        return f" (killed by signal {-code}, {signal.Signals(-code).name})"
    return f" (exit status {code})"


def _reap_child(pid: int) -> Optional[int]:
    """The exit code of this process's dead child ``pid`` (reaps it; negative: the signal), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done else None
