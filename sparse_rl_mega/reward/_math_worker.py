"""A worker process of the math scorer (started by :mod:`sparse_rl_mega.reward.scorer`, not by hand).

Protocol, one JSON value per line: the worker writes ``"ready"`` once math-verify is imported and warm,
then for every line ``[[id, pred, gold], ...]`` read from stdin it writes ``[id, correct, status]`` per
item, in order, as soon as that item is decided. The parent kills the worker when one item takes longer
than its time limit. The worker dies with the parent (``PR_SET_PDEATHSIG``) and exits on end of input.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass  # elsewhere the end of stdin still stops an idle worker
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def main() -> None:
    parent_pid, memory_mb = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent_pid)
    out = os.fdopen(os.dup(1), "wb")  # the protocol channel; anything printed goes to stderr instead
    os.dup2(2, 1)
    logging.disable(logging.CRITICAL)  # math-verify warns on every call made with timeouts disabled
    warnings.simplefilter("ignore")

    from sparse_rl_mega.reward.math import verify_answer

    verify_answer("1", "1")
    verify_answer("(x+1)^2", "x^2+2x+1")  # warm the LaTeX grammar and sympy before the first timed item
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out.write(b'"ready"\n')
    out.flush()
    for line in sys.stdin.buffer:
        for idx, pred, gold in json.loads(line):
            try:
                ok, status = verify_answer(pred, gold)
            except Exception:  # noqa: BLE001 - any failure of the parser or sympy scores 0
                ok, status = False, "error"
            out.write(json.dumps([idx, int(ok), status]).encode() + b"\n")
            out.flush()


if __name__ == "__main__":
    main()
