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
from typing import Any, Callable, Iterable

from sglang_patches.settings import EngineKVSettings


def compressed_bound(settings: EngineKVSettings) -> int:
    return settings.budget + settings.interval + 1


@contextmanager
def effective_max_new_tokens(reqs: Iterable[Any], settings_for: Callable[[Any], EngineKVSettings]):
    saved = []
    try:
        for req in reqs:
            settings = settings_for(req)
            if not settings.enabled:
                continue
            original = req.sampling_params.max_new_tokens
            if original is None:
                continue
            running = req.kv.req_pool_idx is not None and req.kv.kv_allocated_len > 0
            if running:  # what it may still add on top of the slots it owns (the tree holds the rest)
                owned = req.kv.kv_allocated_len - req.kv.cache_protected_len
                bound = len(req.output_ids) + max(0, compressed_bound(settings) - owned)
            else:
                bound = compressed_bound(settings)
            if bound < original:
                saved.append((req, original))
                req.sampling_params.max_new_tokens = bound
        yield
    finally:
        for req, original in saved:
            req.sampling_params.max_new_tokens = original


def install(settings_for: Callable[[Any], EngineKVSettings]) -> None:
    from sglang.srt.managers.schedule_policy import PrefillAdder

    def running(adder) -> list:
        batch = getattr(adder, "running_batch", None)
        return list(batch.reqs) if batch is not None and batch.reqs else []

    # the two admission paths also account the running requests; the offset is per running request
    for name, with_running in (("add_one_req", True), ("add_one_req_ignore_eos", True),
                               ("_get_running_request_total_token_offset", False)):
        original = getattr(PrefillAdder, name)

        def patched(self, req, *args, _original=original, _with_running=with_running, **kwargs):
            with effective_max_new_tokens([req] + (running(self) if _with_running else []), settings_for):
                return _original(self, req, *args, **kwargs)

        setattr(PrefillAdder, name, patched)
