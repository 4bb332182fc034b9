"""The worker processes of the math scorer (started by :mod:`sparse_rl_mega.reward.scorer`, not by hand).

``python -m sparse_rl_mega.reward._math_worker PARENT_PID MEMORY_MB CONTROL_FD`` imports math-verify and
warms it once (~1.5 CPU-s), then forks a worker for every request on ``CONTROL_FD`` (a Unix socket: one
byte carrying two descriptors, the worker's input and output) and answers with the worker's pid (4
bytes, little-endian): a worker replacing one killed at the time limit is ready at once. It dies with
the parent (``PR_SET_PDEATHSIG``), ends when the parent closes the socket, and leaves its workers to the
kernel to reap.

A worker's protocol, one JSON value per line: it writes ``"ready"``, then for every line
``[[id, pred, gold], ...]`` read from its input it writes ``[id, correct, status]`` per item, in order,
as soon as that item is decided. The parent kills the worker when one item takes longer than its time
limit. The worker dies with the forking process, limits its address space to MEMORY_MB, and exits on
end of input.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import warnings

from sparse_rl_mega.reward.math import verify_answer


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass  # elsewhere the end of input still stops an idle worker
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _serve_items(items, out, memory_mb: int) -> None:
    """One worker: answer the items read from ``items`` on ``out`` until end of input."""
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out.write(b'"ready"\n')
    out.flush()
    for line in items:
        for idx, pred, gold in json.loads(line):
            try:
                ok, status = verify_answer(pred, gold)
            except Exception:  # noqa: BLE001 - any failure of the parser or sympy scores 0
                ok, status = False, "error"
            out.write(json.dumps([idx, int(ok), status]).encode() + b"\n")
            out.flush()


def main() -> None:
    parent_pid, memory_mb, control_fd = (int(a) for a in sys.argv[1:4])
    _die_with_parent(parent_pid)
    os.dup2(2, 1)  # anything printed goes to stderr; the channels are the workers' own descriptors
    logging.disable(logging.CRITICAL)  # math-verify warns on every call made with timeouts disabled
    warnings.simplefilter("ignore")

    verify_answer("1", "1")
    verify_answer("(x+1)^2", "x^2+2x+1")  # warm the LaTeX grammar and sympy before the first timed item
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    control = socket.socket(fileno=control_fd)
    forking_pid = os.getpid()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1, 2)
        except OSError:
            return
        if not message:  # the parent closed its end (or ended)
            return
        pid = os.fork()
        if pid == 0:  # a worker: it never returns to this loop
            code = 1
            try:
                control.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _die_with_parent(forking_pid)
                with os.fdopen(fds[0], "rb") as items, os.fdopen(fds[1], "wb") as out:
                    _serve_items(items, out, memory_mb)
                code = 0
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        control.sendall(pid.to_bytes(4, "little"))


if __name__ == "__main__":
    main()
