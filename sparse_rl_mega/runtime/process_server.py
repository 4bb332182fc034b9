"""multiprocessing's forkserver, forked from the calling process instead of started as a new
interpreter.

multiprocessing's own server is a fresh interpreter that imports its preload list: every process it
forks begins with those modules. Forked from a process that has imported what its children need
(torch, Megatron-Core, SGLang: 10-25 CPU-s on these 2-core machines), the server has them at no cost,
and so does every process it forks. The engines' server (``rollout/forkserver.py``), the learner
ranks' server of a single-node CPU job (``forked_ranks.py``) and the launches' server of the tools that
start several launches (``launches.py``) are made here; a forked process takes its caller's environment
(:func:`take_environment`) and may run a script as ``python SCRIPT`` would (:func:`run_script`).

A fork keeps only the calling thread: locks that other threads hold would stay locked in the server,
so it is forked only while this process runs one thread (:func:`threads_running`). The server keeps
only the descriptors multiprocessing's own would have, and asks for SIGKILL when the process that
forked it ends, however it ends (its pipe would not tell: its children hold it open too).
"""
from __future__ import annotations

import multiprocessing.forkserver
import os
import socket
import sys
from typing import Callable, Optional

from sparse_rl_mega.runtime.jobs import die_with_parent


def threads_running() -> int:
    """Threads of this process, as the kernel counts them (not only Python's); 0 where it cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def server_pid() -> Optional[int]:
    """The pid of multiprocessing's forkserver of this process; None before one runs."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


def can_fork_server() -> bool:
    """Whether :func:`fork_server` may run now: one thread here, no server yet."""
    return threads_running() == 1 and server_pid() is None


def fork_server(setup: Optional[Callable[[], None]] = None) -> int:
    """Fork multiprocessing's forkserver from this process (call it when :func:`can_fork_server`);
    ``setup`` runs in the server before it serves. Returns the server's pid; ``Process`` objects of the
    ``forkserver`` context then start as forks of it."""
    from multiprocessing import connection, resource_tracker

    resource_tracker.ensure_running()  # (as multiprocessing's server does: its children get the pipe)
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    sys.stdout.flush()  # (else what is buffered here would be written again by every forked process)
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the server
        try:
            os.close(alive_w)
            _serve(listener.fileno(), alive_r, setup)
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    # multiprocessing's server record (CPython 3.11's ForkServer), as its ensure_running leaves it
    server = multiprocessing.forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


def take_environment(environment: dict[str, str]) -> None:
    """(In a forked process, which has its server's environment) make ``environment`` this process's."""
    try:
        import setproctitle

        setproctitle.getproctitle()  # (sets it up: it relocates the environment, cannot after a clear())
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(environment)


def run_script(script: str, argv: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``argv``, its folder first on ``sys.path``, as ``python SCRIPT
    ARGV`` would (in a forked process that imported what it needs already)."""
    import runpy

    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def _serve(listener_fd: int, alive_r: int, setup: Optional[Callable[[], None]]) -> None:
    """The forked server: only the descriptors multiprocessing's server would have (not this process's
    sockets, lock files or pipes), SIGKILL asked for when the process that forked it ends, ``setup``,
    then multiprocessing's server loop, which returns when every client has gone."""
    keep = {0, 1, 2, listener_fd, alive_r}
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    die_with_parent()
    if setup is not None:
        setup()
    try:
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        pass
