"""Per-request KV eviction inside SGLang's scheduler (runs in the spawned scheduler process).

Before each decode step allocates its slot, every request whose cached length reached
``budget + interval`` is compressed to ``budget`` tokens chosen by a policy of
``sparse_rl_mega.kv``. For position-only policies (the choice is the same for every layer and head)
the request's ``req_to_token`` row is compacted:

* evicted slots the request owns (row positions >= ``cache_protected_len``) go back to the allocator;
  that is the memory the compression saves;
* evicted slots owned by the radix tree (the shared prompt of a GRPO group) are only dropped from this
  request's row: the tree and the other samples of the group keep them;
* ``cache_protected_len``, ``kv_allocated_len``, ``kv_committed_len`` and the batch's ``seq_lens``
  shrink to the kept length; ``req.skip_radix_cache_insert`` keeps the compacted row out of the tree;
* the number of evicted tokens is remembered per request and added to its decode positions, so RoPE
  sees logical positions (kept keys were stored already rotated at their original positions).

Needs ``page_size=1``, the non-overlap scheduler and no speculative decoding (the engine factory in
``sparse_rl_mega.rollout.engine`` sets these).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from sparse_rl_mega.kv.policies import EvictionPolicy, build_policy, should_compress
from sglang_patches.settings import EngineKVSettings

logger = logging.getLogger("sparse_rl_mega.sglang_patches")

OFFSET_ATTR = "_sparse_rl_evicted_positions"


class EngineKVStats:
    """Counters since engine start, plus the peak pool use since the last read."""

    def __init__(self) -> None:
        self.compactions = 0
        self.evicted_tokens = 0
        self.freed_slots = 0
        self.dropped_shared_slots = 0
        self.peak_slots_in_use = 0
        self.pool_size = 0

    def observe_pool(self, allocator: Any) -> None:
        self.pool_size = int(allocator.size)
        in_use = self.pool_size - int(allocator.available_size())
        self.peak_slots_in_use = max(self.peak_slots_in_use, in_use)

    def read_and_reset_peak(self) -> dict:
        out = dict(vars(self))
        self.peak_slots_in_use = 0
        return out


STATS = EngineKVStats()


class RowCompactor:
    """Compacts the rows of requests that must be compressed, before a decode allocation."""

    def __init__(self, settings: EngineKVSettings):
        self.settings = settings
        self.policy: EvictionPolicy = build_policy(settings.policy, sink=settings.sink, window=settings.window)
        self.policy.check_budget(settings.budget)
        if not self.policy.position_only:
            raise NotImplementedError(
                f"policy {settings.policy!r} scores keys; the engine patch compacts position-only policies so far")

    def __call__(self, batch: Any) -> None:
        if not batch.reqs:
            return
        req_to_token = batch.req_to_token_pool.req_to_token
        allocator = batch.tree_cache.token_to_kv_pool_allocator
        seq_lens = batch.seq_lens_cpu.clone()
        freed: list[torch.Tensor] = []
        for i, req in enumerate(batch.reqs):
            cached = int(seq_lens[i])
            if not should_compress(cached, self.settings.budget, self.settings.interval):
                continue
            row_index = req.kv.req_pool_idx
            row = req_to_token[row_index, :cached].clone()
            kept = self.policy.select(None, None, self.settings.budget, length=cached)
            evicted = torch.ones(cached, dtype=torch.bool)
            evicted[kept] = False
            evicted_positions = evicted.nonzero().flatten()
            protected = req.kv.cache_protected_len
            owned = evicted_positions[evicted_positions >= protected]
            freed.append(row[owned])
            req_to_token[row_index, :kept.numel()] = row[kept]
            # kept is ascending, so kept tree-owned positions remain a prefix of the row
            req.kv.cache_protected_len = int((kept < protected).sum())
            req.kv.kv_allocated_len = kept.numel()
            req.kv.kv_committed_len = kept.numel()
            req.skip_radix_cache_insert = True
            setattr(req, OFFSET_ATTR, getattr(req, OFFSET_ATTR, 0) + (cached - kept.numel()))
            seq_lens[i] = kept.numel()
            STATS.evicted_tokens += cached - kept.numel()
            STATS.freed_slots += owned.numel()
            STATS.dropped_shared_slots += evicted_positions.numel() - owned.numel()
            STATS.compactions += 1
        if not freed:
            return
        allocator.free(torch.cat(freed).to(torch.int64))
        batch.seq_lens_cpu = seq_lens.to(batch.seq_lens_cpu.dtype)
        batch.seq_lens = seq_lens.to(device=batch.seq_lens.device, dtype=batch.seq_lens.dtype)
        batch.seq_lens_sum = None


def install(settings: EngineKVSettings) -> None:
    """Hook decode allocation (compaction + pool statistics), decode positions and internal state."""
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController
    from sglang.srt.mem_cache import allocation
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    compactor = RowCompactor(settings) if settings.enabled else None
    default_alloc = allocation.alloc_for_decode_default

    def alloc_for_decode(batch, token_per_req):
        if compactor is not None:
            compactor(batch)
        out_cache_loc = default_alloc(batch, token_per_req)
        STATS.observe_pool(batch.tree_cache.token_to_kv_pool_allocator)
        return out_cache_loc

    for device in ("cpu", "cuda"):
        allocation.ALLOC_FOR_DECODE_FUNCS[device] = alloc_for_decode

    if compactor is not None:
        original_init_new = ForwardBatch.init_new.__func__

        def init_new(cls, batch, model_runner, **kwargs):
            forward_batch = original_init_new(cls, batch, model_runner, **kwargs)
            if forward_batch.forward_mode.is_decode() and batch.reqs:
                offsets = [getattr(req, OFFSET_ATTR, 0) for req in batch.reqs]
                if any(offsets):
                    forward_batch.positions = forward_batch.positions + torch.tensor(
                        offsets, dtype=forward_batch.positions.dtype, device=forward_batch.positions.device)
            return forward_batch

        ForwardBatch.init_new = classmethod(init_new)

    original_state = SchedulerInternalStateController.get_internal_state

    def get_internal_state(self, recv_req):
        output = original_state(self, recv_req)
        output.internal_state["sparse_rl_kv"] = {"settings": vars(settings), **STATS.read_and_reset_peak()}
        return output

    SchedulerInternalStateController.get_internal_state = get_internal_state
    logger.info("sparse_rl_mega KV patch installed: %s", settings)
