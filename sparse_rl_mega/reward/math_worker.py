"""A worker process of the math scorer (started by :mod:`sparse_rl_mega.reward.scorer`, not by hand): a
child of its process's warm server (``runtime/warm_fork.py``), which imported math-verify and warmed it
(:func:`warm_up`, ~1.5 CPU-s once): a worker replacing one killed at the time limit is ready at once.

Its protocol, one JSON value per line: it writes ``"ready"``, then for every line ``[[id, pred, gold],
...]`` read from its input it writes ``[id, correct, status]`` per item, in order, as soon as that item is
decided. The scorer kills the worker when one item takes longer than its time limit. The worker limits
its address space to what it started with plus ``memory_mb`` (a runaway sympy gets ``MemoryError``) and
exits on end of input.
"""
from __future__ import annotations

import json
import logging
import os
import warnings

from sparse_rl_mega.reward.math import verify_answer


def warm_up() -> None:
    """Import math-verify and warm its LaTeX grammar and sympy (before the first timed item)."""
    logging.disable(logging.CRITICAL)  # math-verify warns on every call made with timeouts disabled
    try:
        verify_answer("1", "1")
        verify_answer("(x+1)^2", "x^2+2x+1")
    finally:
        logging.disable(logging.NOTSET)


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def serve_items(items, answers, memory_mb: int) -> None:
    """One worker: answer the items read from the descriptor ``items`` on ``answers`` until end of input
    (both received from the scorer: ``runtime.warm_fork.Descriptor``)."""
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    if memory_mb > 0:
        import resource

        limit = _address_space_bytes() + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with os.fdopen(items.take(), "rb") as lines, os.fdopen(answers.take(), "wb") as out:
        out.write(b'"ready"\n')
        out.flush()
        for line in lines:
            for idx, pred, gold in json.loads(line):
                try:
                    ok, status = verify_answer(pred, gold)
                except Exception:  # noqa: BLE001 - any failure of the parser or sympy scores 0
                    ok, status = False, "error"
                out.write(json.dumps([idx, int(ok), status]).encode() + b"\n")
                out.flush()
