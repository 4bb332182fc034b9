"""One way to start a warmed process: children forked from a server that imported the heavy modules once.

On these CPUs starting a process is mostly imports (torch, Megatron-Core, SGLang: 10-25 CPU-s each).
Every process the project starts on the CPU in quick succession is a fork of one *warm server* per
process: a learner rank (``train/forked_ranks.py``), an SGLang engine's scheduler and detokenizer
(``rollout/forkserver.py``), a math reward worker (``reward/scorer.py``), a launch of the ablation and
bench tools (``cli/launches.py``).

The server is multiprocessing's ``forkserver`` of this process, so torchrun's agent and SGLang, which
start their processes through multiprocessing, fork from it as a ``forkserver`` context is asked to.
:func:`start_server` makes it warm, one of two ways:

* forked from this process, when this process runs one thread (a launcher, a tool): ``modules`` are
  imported here first, and the server has them at no further cost. A fork keeps only the calling
  thread: locks other threads hold would stay locked, hence the one-thread rule.
* else (a test worker, a trainer with MLflow's threads) a new interpreter that imports ``modules`` once,
  started from a thread of this module that lives as long as this process.

Either way the server keeps only the descriptors it serves with, ignores SIGINT and SIGQUIT (a failing
SGLang process sends SIGQUIT to its parent), has no ``atexit`` handler of the process it came from, and
dies (SIGKILL) with that process, however it ends. What it imported was imported under this process's
environment of that moment (:func:`import_environment`): :func:`serves` says whether a child started now
would see its modules as a fresh interpreter would, which callers check before they fork (else they
start fresh interpreters, or spawn).

A child (a :class:`WarmProcess`, or a torchrun rank that calls :func:`become_fresh`) is, where it
matters, the fresh interpreter its caller would have started at that moment:

* inherits: the caller's environment, working folder, ``sys.path``, stdin/stdout/stderr (the
  descriptors, as ``subprocess`` passes them), ``sys.argv`` (a script's: :func:`run_script`), the
  descriptors it is handed (``multiprocessing.reduction.DupFd``); default signal handlers;
* does not inherit: the caller's threads, other descriptors, locks, ``atexit`` handlers, its session
  (with ``new_session``, one of its own); the caller's main module is imported as ``__mp_main__``, as
  multiprocessing does (its work belongs under ``if __name__ == "__main__"``);
* ends: with the code of ``SystemExit`` (0 for a return, 1 and a traceback for an exception, death by
  SIGINT for an unhandled ``KeyboardInterrupt``), after its non-daemon threads and its own ``atexit``
  handlers, output flushed; without tearing down the modules (seconds, for nothing to flush);
* dies with its parent, the server (SIGKILL, ``PR_SET_PDEATHSIG``), so with the process that started
  the server; nothing of it outlives the job. Its exit code comes through the server (``exitcode``): it
  is not the caller's child, and the server reaps it.

On a GPU machine nothing is forked (CUDA state must not be): callers check ``torch.cuda`` first.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.context import ForkServerProcess
from multiprocessing.reduction import DupFd
from typing import Optional
from collections.abc import Callable, Sequence


_PR_SET_PDEATHSIG = 1
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# variables read only after a child starts, never as a module is imported: a caller may set them
# differently from the server's environment (layers above add theirs: read_after_start)
# PYTHONWARNINGS: become_fresh applies it; CUDA_VISIBLE_DEVICES: torch reads it as CUDA initialises (nothing is
# forked where CUDA is available)
_read_after_start: set[str] = {"PYTEST_CURRENT_TEST", "PYTHONWARNINGS", "CUDA_VISIBLE_DEVICES"}
_server_environment: Optional[dict[str, str]] = None  # what the server's modules were imported under (filtered
# as they are compared: a variable may be declared read-after-start later)
_how: Optional[str] = None  # "forked" or "started": how this process's server came to be
_served_environment: dict[str, str] = {}  # (in the server and its children) os.environ as the server began
_serving_pid: Optional[int] = None  # (in the server and its children) the server's pid
_lock = threading.Lock()
_starter: Optional[ThreadPoolExecutor] = None  # starts a new-interpreter server; lives as long as this process


def die_with_parent(signum: int = signal.SIGKILL, parent: Optional[int] = None) -> None:
    """This process gets ``signum`` (SIGKILL unless asked otherwise) when the process that started it
    (``parent``, if known: it may have ended already) ends, however it ends: no learner rank outlives its
    job (its engine's processes die with it in turn, they ask the same of their parent). A launcher
    started by a tool asks for SIGTERM, so that it stops its job as a user's SIGTERM would."""
    parent = os.getppid() if parent is None else parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return  # not Linux: nothing to ask for
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def read_after_start(*names: str) -> None:
    """Declare environment variables that no module reads as it is imported (only after a child starts):
    a caller's value of them may differ from the server's (:func:`serves`)."""
    _read_after_start.update(names)


def import_environment(environment: Optional[dict[str, str]] = None) -> dict[str, str]:
    """This process's environment (or ``environment``) as modules imported under it would read it."""
    return {k: v for k, v in (os.environ if environment is None else environment).items() if k not in _read_after_start}


def threads_running() -> int:
    """Threads of this process, as the kernel counts them (not only Python's); 0 where it cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def server_pid() -> Optional[int]:
    """The pid of this process's server while it runs; None before one runs or once it has ended."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    return pid if pid is not None and running(pid) else None


def how_started() -> Optional[str]:
    """``forked`` (from this process), ``started`` (a new interpreter) or None (no warm server)."""
    return _how if server_pid() is not None else None


def serves() -> bool:
    """Whether a child started now comes from a warm server whose modules were imported under this
    process's environment (as a fresh interpreter started now would import them)."""
    return server_pid() is not None and import_environment(_server_environment) == import_environment()


def differences() -> list[str]:
    """The variables whose values differ between this process's import environment and the server's."""
    if _server_environment is None:
        return []
    theirs, ours = import_environment(_server_environment), import_environment()
    return sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))


def start_server(modules: Sequence[str] = ()) -> bool:
    """Make this process's server a warm one that imported ``modules`` (names; ``"module:function"``
    also calls that function after the import, e.g. to import a library under other variables), forked
    from this process when it runs one thread, else a new interpreter (module docstring). A server that
    runs already stays (it cannot learn more modules; a child imports what it lacks). True when
    :func:`serves`. The caller checks for CUDA first."""
    global _server_environment, _how, _starter
    with _lock:
        if server_pid() is None:
            if threads_running() == 1:
                for entry in modules:
                    _import(entry)
            # (after the imports, which may set variables: a forked server has what they set)
            _server_environment = dict(os.environ)
            if threads_running() == 1:  # (an import may have started a thread)
                _fork_server()
                _how = "forked"
            else:
                _starter = _starter or ThreadPoolExecutor(1, thread_name_prefix="warm-server")
                _starter.submit(_start_server, list(modules)).result()
                _how = "started"
    return serves()


def _import(entry: str) -> None:
    name, _, function = entry.partition(":")
    module = importlib.import_module(name)
    if function:
        getattr(module, function)()


def _server_endpoint() -> tuple[socket.socket, str, int, int]:
    """The listening socket, its address and the alive pipe (read end, write end) of a new server."""
    from multiprocessing import connection, resource_tracker

    resource_tracker.ensure_running()  # (as multiprocessing's server: its children get the tracker's pipe)
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    return listener, address, alive_r, alive_w


def _record(address: str, alive_w: int, pid: int) -> None:
    """multiprocessing's server record (CPython 3.11's ForkServer) as its ``ensure_running`` leaves it."""
    server = multiprocessing.forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _fork_server() -> None:
    listener, address, alive_r, alive_w = _server_endpoint()
    sys.stdout.flush()  # (else what is buffered here would be written again by every child)
    sys.stderr.flush()
    caller = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            _forget_server()  # (its children start with no server of their own: they may make one)
            _main_file_as_children_are_told()
            _serve(listener.fileno(), alive_r, caller)
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    _record(address, alive_w, pid)


def _main_file_as_children_are_told() -> None:
    """(In a forked server) the caller's main module's ``__file__`` spelled as multiprocessing names it to
    each child (``spawn.get_preparation_data``: joined to the start folder, then ``normpath``). A child
    that finds another spelling of the same file in its ``__main__`` (``python dir/../x.py``, ``./x.py``)
    runs the caller's script again as ``__mp_main__`` (``spawn._fixup_main_from_path``); the server
    already holds that module."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:  # (-m: by name)
        return
    if not os.path.isabs(path) and multiprocessing.process.ORIGINAL_DIR is not None:
        path = os.path.join(multiprocessing.process.ORIGINAL_DIR, path)
    main.__file__ = os.path.normpath(path)


def _forget_server() -> None:
    """(In a forked server) this module's state as in a process that has made no server yet; the lock,
    held by the caller as it forked, anew."""
    global _lock, _how, _server_environment, _starter
    _lock, _how, _server_environment, _starter = threading.Lock(), None, None, None
    _record(None, None, None)


def _start_server(modules: list[str]) -> None:
    """(On the starter thread: the server dies when the thread that started it ends.)"""
    listener, address, alive_r, alive_w = _server_endpoint()
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", "from sparse_rl_mega.runtime.warm_fork import serve_started; serve_started()",
               str(os.getpid()), str(listener.fileno()), str(alive_r), *modules]
    process = subprocess.Popen(command, pass_fds=(listener.fileno(), alive_r), stdin=subprocess.DEVNULL, env=environment)
    os.close(alive_r)
    listener.close()
    _record(address, alive_w, process.pid)
    threading.Thread(target=process.wait, daemon=True, name="warm-server-reaper").start()


def _serve(listener_fd: int, alive_r: int, caller: int) -> None:
    """The server: only its own descriptors, SIGKILL asked for when its parent ends, SIGINT and SIGQUIT
    ignored, no inherited ``atexit`` handler, then multiprocessing's server loop, which returns when
    the process that started it has gone."""
    keep = {0, 1, 2, listener_fd, alive_r}
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    global _served_environment, _serving_pid
    die_with_parent(parent=caller)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    _served_environment, _serving_pid = dict(os.environ), os.getpid()
    atexit._clear()  # (the handlers of the process it came from are not its children's)
    try:
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        pass


# ----------------------------------------------------------------------------------------------- children


class Descriptor:
    """A descriptor of the caller handed to a child (pickled with it: ``DupFd``); :meth:`take` there."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _Received, (DupFd(self.fd),)


class _Received:
    def __init__(self, duplicate) -> None:
        self.duplicate = duplicate

    def take(self) -> int:
        """The descriptor in this process (its own copy: the child closes it)."""
        return self.duplicate.detach()


def caller_stdio() -> tuple[Descriptor, Descriptor, Descriptor]:
    """This process's stdin, stdout and stderr, to hand to a child."""
    return Descriptor(0), Descriptor(1), Descriptor(2)


def become_fresh(environment: dict[str, str], stdio=None, new_session: bool = False) -> None:
    """(First thing in a child) what a fresh interpreter started by the caller would have: death with the
    parent, default signal handlers, ``stdio`` (three received descriptors) as 0, 1, 2, ``environment``
    (and the warning filters its ``PYTHONWARNINGS`` names);
    with ``new_session`` a session of its own (a timeout kills its whole group)."""
    die_with_parent(parent=_serving_pid)  # (the server may have ended since it forked this process)
    if new_session:
        os.setsid()
    for signum in (signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD,
                   signal.SIGALRM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if stdio is not None:
        for target, received in zip((0, 1, 2), stdio):
            fd = received.take()
            os.dup2(fd, target)
            os.close(fd)
    take_environment(environment)
    if environment.get("PYTHONWARNINGS"):  # (what an interpreter does with it as it starts)
        warnings._processoptions(environment["PYTHONWARNINGS"].split(","))


def variables_set_since_start() -> dict[str, str]:
    """(In a child, before :func:`become_fresh`) the variables set in it since its server began (by
    multiprocessing's caller in the child, e.g. torchrun's per-rank variables)."""
    return {k: v for k, v in os.environ.items() if _served_environment.get(k) != v}


def take_environment(environment: dict[str, str]) -> None:
    """Make ``environment`` this process's (a child has its server's)."""
    try:
        import setproctitle

        setproctitle.getproctitle()  # (sets it up: it relocates the environment, cannot after a clear())
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(environment)


def end_as_interpreter(run: Callable[[], None]) -> None:
    """Run ``run`` and end as an interpreter ends (module docstring); raises ``SystemExit`` with the code."""
    code: object = 0
    interrupted = False
    try:
        run()
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt:
        interrupted = True
        sys.excepthook(*sys.exc_info())
    except BaseException:  # noqa: BLE001 (any end but a Ctrl-C: reported, exit status 1)
        code = 1
        sys.excepthook(*sys.exc_info())
    threading._shutdown()  # (an interpreter's end, as multiprocessing's bootstrap does: threads joined first)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(code)


def run_script(script: str, argv: Sequence[str]) -> None:
    """Run ``script`` as ``__main__`` with ``argv``, its folder first on ``sys.path``, as ``python SCRIPT
    ARGV`` would (in a child that has what it imports)."""
    import runpy

    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


class WarmProcess(ForkServerProcess):
    """A child of this process's warm server, started as ``multiprocessing.Process`` is (``target``,
    ``args``; ``start``, ``join``, ``exitcode``, ``pid``), which behaves as a fresh interpreter started by
    the caller at ``start`` would (module docstring). ``stdio``: three :class:`Descriptor` (default: the
    caller's); ``env``: its environment (default: the caller's at ``start``). Subclasses add to
    :meth:`prepare`."""

    def __init__(self, *args, stdio=None, env: Optional[dict[str, str]] = None, new_session: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stdio, self._env, self._new_session = stdio, env, new_session

    def start(self) -> None:
        self._environment = dict(os.environ if self._env is None else self._env)
        self._stdio = self._stdio or caller_stdio()
        sys.stdout.flush()
        sys.stderr.flush()
        super().start()

    def prepare(self) -> None:
        """(In the child, after :func:`become_fresh`, before the target.)"""

    def run(self) -> None:
        become_fresh(self._environment, self._stdio, self._new_session)
        self.prepare()
        end_as_interpreter(super().run)


def serve_started() -> None:
    """The new-interpreter server (:func:`start_server`): ``python -c ... CALLER_PID LISTENER_FD ALIVE_FD MODULE...``."""
    caller, listener_fd, alive_r, *modules = sys.argv[1:]
    die_with_parent(parent=int(caller))  # (before the imports: a caller that ends meanwhile takes it along)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # (already while SGLang imports)
    for entry in modules:
        _import(entry)
    _serve(int(listener_fd), int(alive_r), int(caller))
