"""Admission that knows compressed requests stay small.

SGLang admits a request only when the pool can hold its prompt plus its whole ``max_new_tokens``
(scaled by the new-token ratio), and keeps that reservation for running requests. A request whose KV
is compressed to ``budget`` every ``interval`` steps never holds more than ``budget + interval + 1``
of its own slots, so reserving ``max_new_tokens`` (e.g. 4096 for a 512-token budget) admits far fewer
requests than the pool can run. While the prefill adder decides, each compressed request's
``max_new_tokens`` is replaced by its real bound (restored right after, so stopping is unchanged):

* a waiting request: ``min(max_new_tokens, budget + interval + 1)``;
* a running request: ``len(output) + max(0, budget + interval + 1 - slots it owns now)`` (a shared
  prompt's slots belong to the radix tree and are counted there).

The bound is exact for the slots a request owns; decode still checks memory every step, so a tight
pool retracts as stock SGLang does (a retracted request restarts dense, see ``kv_eviction``).
"""
from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Callable

from sparse_rl_mega.kv.engine_settings import EngineKVSettings, compressed_bound
from sparse_rl_mega.rollout import sglang_internals as sglang


@contextmanager
def effective_max_new_tokens(requests: list[sglang.Request], settings_for: Callable[[sglang.Request], EngineKVSettings]):
    saved = []
    try:
        for request in requests:
            settings = settings_for(request)
            if not settings.enabled:
                continue
            original = request.max_new_tokens
            if original is None:
                continue
            running = request.row is not None and request.allocated > 0
            if running:  # what it may still add on top of the slots it owns (the tree holds the rest)
                owned = request.allocated - request.protected
                bound = request.output_len + max(0, compressed_bound(settings) - owned)
            else:
                bound = compressed_bound(settings)
            if bound < original:
                saved.append((request, original))
                request.max_new_tokens = bound
        yield
    finally:
        for request, original in saved:
            request.max_new_tokens = original


def install(settings_for: Callable[[sglang.Request], EngineKVSettings]) -> None:
    sglang.hook_admission(lambda requests: effective_max_new_tokens(requests, settings_for))
