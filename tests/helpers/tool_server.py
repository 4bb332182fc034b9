"""The suite's runs of ``python tools/X.py ARGS`` (and of its torchrun helper), as forks of one process
per test worker that imported what those scripts import once: torch, Megatron-Core, SGLang,
transformers' models (not MLflow: importing it starts a thread).

As fresh interpreters, ~45 runs of the suite each imported them again: 3-15 CPU-s of a 2-core machine
per run. A fork runs the script as ``python SCRIPT ARGS`` would: in a session of its own (a test's
timeout kills its whole process group), in the repo root, with the script's folder first on
``sys.path``, ``sys.argv`` set and stdin empty, under the test worker's environment as the server
started plus the call's variables; it ends as that interpreter would (the code of ``SystemExit``, a
traceback and 1 for an exception, threads joined, ``atexit`` handlers run), but without tearing down the
preloaded modules (2 s each). SGLang's modules are imported as a CPU launcher imports them
(``rollout.engine.import_cpu_engine_modules``: under the engine processes' environment). A call that sets
a variable modules may read as they are imported (other than :data:`READ_AFTER_IMPORT`) runs as a fresh
interpreter instead.

What a fork cannot show (a script that imports too little to start alone, the launcher's start-up in a
fresh interpreter), fresh interpreters still show: every tool's ``--help`` (tests/test_tools.py), the
end-to-end launch, the killed launcher, the two-node torchrun launches and the GPU check.

The server: ``python tests/helpers/tool_server.py SOCKET``; a request is one JSON line (script, args,
env, cwd, stdout and stderr file paths), the answer one line ``{"pid": P}`` as it forks and one
``{"exit": CODE}`` as the process ends (negative: the signal, as ``subprocess`` says it). The server is a
child of the test worker and is killed with it (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
# read only after the scripts start (by pytest, the fault injector and the engines' KV plugin), so a run
# may set them differently from the server's environment
READ_AFTER_IMPORT = frozenset({"PYTEST_CURRENT_TEST", "SPARSE_RL_MEGA_FAULT", "SPARSE_RL_MEGA_KV"})
# what the scripts import beyond a launcher's ranks (forked_ranks.RANK_MODULES; SGLang's modules come
# first, under the engines' environment): torchrun's agent, export's writer, transformers' models
PRELOAD = ("sparse_rl_mega.train.forked_ranks", "safetensors.torch", "torch.distributed.run", "torch.distributed.launcher.api",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen3.modeling_qwen3")


# ----------------------------------------------------------------------------- the server


def _preload() -> None:
    sys.path.insert(0, str(ROOT))
    from sparse_rl_mega.runtime import process_server
    from sparse_rl_mega.train.forked_ranks import RANK_MODULES
    from sparse_rl_mega.rollout.engine_processes import import_cpu_engine_modules

    import_cpu_engine_modules()
    for name in (*RANK_MODULES, *PRELOAD):
        importlib.import_module(name)
    # MLflow's client and SQL store (rank 0 of a launch, the tools that read results): pyarrow, which
    # it loads, starts jemalloc's background thread unless told not to (here, for the import)
    os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
    for name in ("mlflow", "mlflow.store.tracking.sqlalchemy_store"):
        importlib.import_module(name)
    del os.environ["JE_ARROW_MALLOC_CONF"]
    sys.path.remove(str(ROOT))
    if process_server.threads_running() != 1:  # a fork keeps one thread: others' locks would stay held
        raise SystemExit(f"tool_server: {process_server.threads_running()} threads after the imports (1 expected)")


def _serve(listener: socket.socket) -> dict:
    """Fork a process per request; return the request in that process (never in the server)."""
    from sparse_rl_mega.runtime.jobs import die_with_parent

    die_with_parent()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    waiting: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while True:
        ready, _, _ = select.select([listener, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _answer(waiting.pop(pid), {"exit": os.waitstatus_to_exitcode(status)})
        if listener in ready:
            connection, _ = listener.accept()
            request = json.loads(connection.makefile().readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for other in [listener, connection, *waiting.values()]:
                    other.close()
                return request
            waiting[pid] = connection
            _answer(connection, {"pid": pid}, close=False)


def _answer(connection: socket.socket, answer: dict, close: bool = True) -> None:
    """One answer line; a client that has gone (a failed test) leaves the server serving the others."""
    try:
        connection.sendall(json.dumps(answer).encode() + b"\n")
    except OSError:
        pass
    if close:
        connection.close()


def _become(request: dict) -> str:
    """In the forked process: what ``python SCRIPT ARGS`` would have; returns the script's path."""
    from sparse_rl_mega.runtime.process_server import take_environment

    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        if fd == 2 and path == request["stdout"]:  # (one file for both, as stderr=subprocess.STDOUT)
            os.dup2(1, 2)
            continue
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    take_environment(request["env"])
    script = os.path.abspath(request["script"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)  # (python SCRIPT puts the script's folder first)
    return script


def _run_as_main(script: str) -> None:
    """Run ``script`` as ``__main__`` and end as an interpreter ends, apart from tearing down the
    modules (2 s for the server's: nothing to flush there): the exit code of ``SystemExit``, a traceback
    and 1 for an exception (death by SIGINT for an unhandled Ctrl-C), non-daemon threads joined,
    ``atexit`` handlers run, output flushed."""
    import atexit
    import runpy
    import threading

    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT
        sys.excepthook(*sys.exc_info())
    except BaseException:
        code = 1
        sys.excepthook(*sys.exc_info())
    threading._shutdown()  # (what the interpreter's end does first)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def main() -> None:
    _preload()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[1])
    listener.listen()
    print("tool_server: ready", flush=True)
    _run_as_main(_become(_serve(listener)))


# ----------------------------------------------------------------------------- the client (the test worker)


class ForkedRun:
    """One script run as a fork of the server, as ``subprocess.Popen`` shows one: ``pid``, :meth:`poll`,
    :meth:`wait` (``subprocess.TimeoutExpired`` when it runs on), ``returncode``."""

    def __init__(self, connection: socket.socket, args: list[str]):
        self.connection, self.args, self.buffer, self.returncode = connection, args, b"", None
        self.pid = self._answer(None)["pid"]

    def _answer(self, timeout: Optional[float]) -> Optional[dict]:
        """The server's next answer (a JSON line); None if none came within ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.connection], [], [], left)[0]:
                return None
            chunk = self.connection.recv(4096)
            if not chunk:
                raise RuntimeError(f"the tool server ended while {self.args} ran (pid {getattr(self, 'pid', '?')})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            answer = self._answer(timeout)
            if answer is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = answer["exit"]
            self.connection.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None


class ToolServer:
    """The test worker's side: starts the server on first use, runs a script as a fork of it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.address = str(folder / "tool_server.sock")
        self.log = folder / "tool_server.log"
        self.environment = dict(os.environ)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, __file__, self.address], cwd=ROOT, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)
        self.runs = 0

    def _wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while "tool_server: ready" not in self.log.read_text():
            if self.process.poll() is not None:
                raise RuntimeError(f"the tool server ended (exit code {self.process.returncode}): {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tool server was not ready in {timeout:.0f} s: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def can_run(self, env: dict[str, str]) -> bool:
        """Whether a run with the variables ``env`` added may be a fork (none read as modules are imported)."""
        return all(self.environment.get(k) == v or k in READ_AFTER_IMPORT for k, v in env.items())

    def start(self, script: Path, args: list, env: dict[str, str], stdout: Path, stderr: Path) -> ForkedRun:
        """``python SCRIPT ARGS`` from the repo root as a fork of the server, its output written to
        ``stdout`` and ``stderr``, under the test worker's environment as the server started plus ``env``
        (an SGLang engine run in the worker leaves its settings in the worker's environment, which a
        user's shell would not pass on)."""
        self._wait_ready()
        connection = socket.socket(socket.AF_UNIX)
        connection.connect(self.address)
        request = dict(script=str(script), args=[str(a) for a in args], env={**self.environment, **env}, cwd=str(ROOT),
                       stdout=str(stdout), stderr=str(stderr))
        connection.sendall(json.dumps(request).encode() + b"\n")
        return ForkedRun(connection, [sys.executable, str(script), *map(str, args)])

    def run(self, script: Path, args: list, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """:meth:`start` with the output captured; on timeout its process group is killed (as
        ``tests/conftest.py``'s ``run_captured`` kills a fresh one's)."""
        self.runs += 1
        out, err = self.folder / f"run{self.runs}.out", self.folder / f"run{self.runs}.err"
        run = self.start(script, args, env, out, err)
        note = ""
        try:
            run.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            note = f"\n[test] killed after {timeout} s"
            run.wait(60)  # (the server answers as it reaps the process)
        done = subprocess.CompletedProcess(run.args, run.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace") + note)
        out.unlink()
        err.unlink()
        return done

if __name__ == "__main__":
    main()
