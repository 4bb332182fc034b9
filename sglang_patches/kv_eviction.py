"""Per-request KV eviction inside SGLang's scheduler (runs in the spawned scheduler process).

Before each decode step allocates its slot, every request whose cached length reached
``budget + interval`` (and, for policies that score with queries, that has run ``window`` decode
steps) is compressed to ``budget`` tokens chosen by a policy of ``sparse_rl_mega.kv``:

* one set for every layer (StreamingLLM, and ``selection: shared`` of the scoring policies, as the
  paper's release does): the request's ``req_to_token`` row is compacted in place (no KV data moves);
* a set per layer or per KV head (SnapKV, R-KV, H2O with ``per_layer`` / ``per_head``): each layer's
  kept K/V are copied into slots the request owns (its own decode slots, plus fresh ones when a long
  shared prompt leaves it too few), so the row then holds layer-specific content and the radix tree's
  slots are never written.

At engine TP > 1 every rank scores its own KV heads; per-layer and shared choices all-gather the
per-head scores over SGLang's TP group first (:func:`tp_head_gather`), so every rank keeps the same
tokens and the choice does not depend on the TP degree.

In both cases evicted slots the request owns go back to the allocator (the memory the compression
saves); evicted slots owned by the radix tree (the GRPO group's shared prompt) are only dropped from
this request's row; ``req.skip_radix_cache_insert`` keeps the compressed row out of the tree; the
number of evicted tokens is remembered and added to the request's decode positions so RoPE sees
logical positions (kept keys were stored already rotated).

Decode queries (post-RoPE, per layer) are recorded by a hook on ``RadixAttention.forward`` into a
ring of ``window`` per request row. H2O's accumulated attention is added from that ring in one
batched pass whenever the ring is full or the request is about to be compressed (rather than a second
attention pass every decode step): between compressions a request's keys only grow, so each recorded
query still sees exactly the keys it saw when it was decoded. A retracted request loses this state and
restarts dense. The hook runs Python on CPU-side state, so a GPU engine with a scoring policy runs
without CUDA graphs (``sglang_patches.settings.cuda_graphs_allowed``).

Needs ``page_size=1``, the non-overlap scheduler and no speculative decoding (the engine factory in
``sparse_rl_mega.rollout.engine`` sets these).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Optional

import torch

from sparse_rl_mega.kv.policies import EvictionPolicy, build_policy, should_compress, window_attention_mass
from sglang_patches.settings import (MASS_HEADROOM, REQUEST_KEY, EngineKVSettings, records_queries,
                                     ring_layers, scoring_bytes_per_request, scoring_chunk)

logger = logging.getLogger("sparse_rl_mega.sglang_patches")

OFFSET_ATTR = "_sparse_rl_evicted_positions"
PLAN_ATTR = "_sparse_rl_kv_plan"
RETRACTIONS_ATTR = "_sparse_rl_retractions"


class EngineKVStats:
    """Counters since engine start, plus the peak pool use since the last read."""

    def __init__(self) -> None:
        self.compactions = 0
        self.evicted_tokens = 0
        self.freed_slots = 0
        self.dropped_shared_slots = 0
        self.copied_tokens = 0
        self.skipped_no_room = 0
        self.retractions = 0
        # wall time spent in this patch: before decode steps (compression, H2O's attention mass) and in
        # the attention hook (query recording); the benchmark reports them next to the run time
        self.compress_seconds = 0.0
        self.hook_seconds = 0.0
        self.peak_slots_in_use = 0
        self.pool_size = 0
        # side buffers beside SGLang's pool: the decode-query ring (allocated once) and H2O's per-request
        # attention mass (now and at its peak)
        self.query_ring_bytes = 0
        self.h2o_mass_bytes = 0
        self.h2o_mass_peak_bytes = 0

    def observe_mass(self, buffers) -> None:
        self.h2o_mass_bytes = sum(t.numel() * t.element_size() for t in buffers)
        self.h2o_mass_peak_bytes = max(self.h2o_mass_peak_bytes, self.h2o_mass_bytes)

    def observe_pool(self, allocator: Any) -> None:
        self.pool_size = int(allocator.size)
        in_use = self.pool_size - int(allocator.available_size())
        self.peak_slots_in_use = max(self.peak_slots_in_use, in_use)

    def read_and_reset_peak(self) -> dict:
        out = dict(vars(self))
        self.peak_slots_in_use = 0
        self.h2o_mass_peak_bytes = self.h2o_mass_bytes
        return out


STATS = EngineKVStats()


class RowState:
    """Per ``req_to_token`` row: recorded decode queries (a ring of ``window``) and, for H2O, the
    attention mass each cached position received from the queries already added (``pending`` more
    wait in the ring). Rows are reused by later requests: the owner is checked before every decode
    step and a new owner starts empty.

    Memory (docs/kv_compression.md, "Side buffers"): the ring is one dense tensor over the request pool
    (``max_running_requests + 1`` rows) and ``layers`` layers (only the first layer when every request
    chooses a shared set from it); H2O's mass is held per running request and sized by its current
    length (at most prompt + budget + interval + 1), never by the model's context length."""

    def __init__(self, window: int, keep_queries: bool, first_layer_only: bool):
        self.window = window
        self.keep_queries = keep_queries
        self.first_layer_only = first_layer_only  # record / accumulate the first layer only
        self.owner: dict[int, tuple] = {}     # row -> (request id, its retraction count)
        self.steps: dict[int, int] = {}       # row -> decode queries recorded for the owner
        self.pending: dict[int, int] = {}     # row -> recorded queries not yet added to ``mass`` (H2O)
        self.queries: Optional[torch.Tensor] = None  # [rows, ring layers, window, q_heads, d]
        self.mass: dict[int, torch.Tensor] = {}      # row -> [ring layers, kv_heads, capacity] float32

    def claim(self, row: int, req: Any) -> None:
        key = (req.rid, getattr(req, RETRACTIONS_ATTR, 0))  # rid: unique, unlike id() of a freed object
        if self.owner.get(row) != key:
            self.owner[row] = key
            self.steps[row] = 0
            self.pending[row] = 0
            if self.mass.pop(row, None) is not None:
                STATS.observe_mass(self.mass.values())

    def drop_mass_except(self, running_rows: set) -> None:
        """Free the mass of rows whose request no longer runs (every running request decodes each step)."""
        gone = [row for row in self.mass if row not in running_rows]
        for row in gone:
            del self.mass[row]
        if gone:
            STATS.observe_mass(self.mass.values())

    def ring_layers(self, layers: int) -> int:
        return 1 if self.first_layer_only else layers

    def ensure_queries(self, rows: int, layers: int, q_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        if self.keep_queries and self.queries is None:
            self.queries = torch.zeros(rows, self.ring_layers(layers), self.window, q_heads, head_dim, dtype=dtype,
                                       device=device)
            STATS.query_ring_bytes = self.queries.numel() * self.queries.element_size()

    def mass_of(self, row: int, length: int, shape: tuple[int, int], device) -> torch.Tensor:
        """The row's mass over its first ``length`` positions, ``[ring layers, kv_heads, length]`` (a view;
        zeros where nothing was added yet). Grows the row's buffer when its request grew past it."""
        held = self.mass.get(row)
        if held is None or held.shape[-1] < length:
            grown = torch.zeros(*shape, length + MASS_HEADROOM, dtype=torch.float32, device=device)
            if held is not None:
                grown[..., :held.shape[-1]] = held
            self.mass[row] = held = grown
            STATS.observe_mass(self.mass.values())
        return held[..., :length]

    def keep_mass_at(self, row: int, kept: torch.Tensor) -> None:
        """After a compression: the row keeps the mass of its kept positions ``kept [layers or 1, h or 1, B]``."""
        held = self.mass[row]
        index = kept.expand(held.shape[0], held.shape[1], -1)
        kept_mass = held.gather(-1, index)
        held.zero_()
        held[..., :kept_mass.shape[-1]] = kept_mass

    def ring_queries(self, rows: list[int]) -> torch.Tensor:
        """Each row's whole ring, oldest first: ``[len(rows), ring layers, q_heads, window, d]``."""
        order = torch.tensor([[(self.steps[row] + j) % self.window for j in range(self.window)] for row in rows],
                             device=self.queries.device)
        ring = self.queries[rows]  # [n, layers, window, q_heads, d]
        ring = ring.gather(2, order[:, None, :, None, None].expand_as(ring))
        return ring.transpose(2, 3)


def tp_head_gather() -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """With engine TP > 1: a function that all-gathers per-head scores ``[..., local_heads, M]`` (head
    axis 2) over SGLang's TP group into every head in model order (rank r holds heads
    ``r * local .. (r + 1) * local - 1``), so a per-layer or shared choice is the same on every rank and
    at every TP degree. ``None`` at TP 1. Engines whose TP exceeds the KV heads are refused before they
    start (``sparse_rl_mega.rollout.engine``): a replicated head's query group is split over ranks."""
    import torch.distributed as dist
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return None

    def gather(scores: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(scores) for _ in range(group.world_size)]
        dist.all_gather(parts, scores.contiguous(), group=group.device_group if scores.is_cuda else group.cpu_group)
        return torch.cat(parts, dim=2)

    return gather


class Compressor:
    """Compresses the rows of requests that must be compressed, before a decode allocation."""

    def __init__(self, settings: EngineKVSettings):
        self.settings = settings
        self._policies: dict[str, EvictionPolicy] = {}
        if settings.enabled:
            self.policy_for(settings)  # a bad setting fails at engine start, not at the first compression
        # with per-request overrides any policy may show up: record what every policy needs
        self.rows = RowState(settings.window, keep_queries=records_queries(settings),
                             first_layer_only=ring_layers(settings, 2) == 1)
        self.scaling: Optional[float] = None  # attention scaling, seen by the hook
        self._gather_heads: Any = False  # resolved at the first compression (the TP group exists then)
        # the scheduler and the model runner share one process (non-overlap, TP per process):
        # the attention hooks reach the pools through these references, set at each decode step
        self.req_to_token: Optional[torch.Tensor] = None
        self.kv_pool: Any = None
        self.step_slots: tuple[torch.Tensor, torch.Tensor] = (torch.zeros(0, dtype=torch.int64),) * 2

    def policy_for(self, settings: EngineKVSettings) -> EvictionPolicy:
        key = json.dumps(settings.to_dict(), sort_keys=True)
        if key not in self._policies:
            policy = build_policy(settings.policy, sink=settings.sink, window=settings.window,
                                  selection=settings.selection, shared_scores=settings.shared_scores,
                                  **settings.params)
            policy.check_budget(settings.budget)
            self._policies[key] = policy
        return self._policies[key]

    def plan_for(self, req: Any) -> tuple[EngineKVSettings, Optional[EvictionPolicy]]:
        """The request's settings (the engine's, updated by its ``custom_params["sparse_rl_kv"]`` if
        allowed) and policy (None when off). Resolved once per request: they never change, and the
        scheduler asks for them every decode step and every admission decision."""
        plan = getattr(req, PLAN_ATTR, None)
        if plan is None:
            custom = getattr(req.sampling_params, "custom_params", None) or {}
            override = custom.get(REQUEST_KEY) if self.settings.allow_request_override else None
            settings = self.settings.updated(override) if override else self.settings
            plan = (settings, self.policy_for(settings) if settings.enabled else None)
            setattr(req, PLAN_ATTR, plan)
        return plan

    def settings_for(self, req: Any) -> EngineKVSettings:
        return self.plan_for(req)[0]

    def __call__(self, batch: Any) -> None:
        if not batch.reqs:
            return
        req_to_token = batch.req_to_token_pool.req_to_token
        allocator = batch.tree_cache.token_to_kv_pool_allocator
        self.req_to_token, self.kv_pool = req_to_token, allocator.get_kvcache()
        if self._gather_heads is False:
            self._gather_heads = tp_head_gather()
        self.rows.drop_mass_except({req.kv.req_pool_idx for req in batch.reqs})  # finished requests' mass
        seq_lens = batch.seq_lens_cpu.clone()
        lengths = seq_lens.tolist()
        freed: list[torch.Tensor] = []
        scoring: dict[tuple, list] = {}  # (policy, cached length) -> requests to compress together
        mass_rows: list[int] = []  # H2O rows: their next query goes into the mass
        add_mass: list[tuple[int, int]] = []  # (row, cached length): add the ring's pending queries now
        for i, req in enumerate(batch.reqs):
            row = req.kv.req_pool_idx
            self.rows.claim(row, req)
            settings, policy = self.plan_for(req)
            cached = lengths[i]
            if policy is None:
                continue
            at_newline = bool(settings.newline_token_ids) and bool(req.output_ids) and \
                req.output_ids[-1] in settings.newline_token_ids
            due = should_compress(cached, settings.budget, settings.interval, self.rows.steps[row],
                                  policy.min_decode_queries, at_newline)
            if policy.needs_accumulated:
                mass_rows.append(row)
                pending = self.rows.pending[row]
                if pending and (due or pending == self.rows.window):  # before compressing or overwriting
                    add_mass.append((row, cached))
            if not due:
                continue
            if policy.position_only:
                kept = policy.select(None, None, settings.budget, length=cached)
                seq_lens[i] = self._compact(req, row, cached, kept, req_to_token, freed)
            else:
                scoring.setdefault((id(policy), cached), []).append((i, req, row, policy, settings))
        if add_mass:
            self._add_pending_mass(add_mass)
        for (_, cached), group in scoring.items():
            # all samples of a GRPO group reach the trigger at the same step: score them in chunks within
            # the settings' scoring_workspace_bytes (the same chunks on every TP rank)
            key_buffer, settings = self.kv_pool.get_key_buffer(self.kv_pool.start_layer), group[0][4]
            chunk = scoring_chunk(settings, scoring_bytes_per_request(
                settings, layers=self.kv_pool.layer_num, kv_heads=key_buffer.shape[1], head_dim=key_buffer.shape[2],
                dtype_bytes=key_buffer.element_size(), length=cached))
            for part in (group[k:k + chunk] for k in range(0, len(group), chunk)):
                if part[0][3].shared:
                    for (i, req, row, _, _), kept in zip(part, self._choose(part, cached)):
                        seq_lens[i] = self._compact(req, row, cached, kept, req_to_token, freed)
                        if row in self.rows.mass:
                            self.rows.keep_mass_at(row, kept[None, None])
                else:
                    for i, kept_len in self._rewrite(part, cached, req_to_token, allocator, freed,
                                                     decode_slots=len(batch.reqs), tree_cache=batch.tree_cache):
                        seq_lens[i] = kept_len
        rows = [req.kv.req_pool_idx for req in batch.reqs]
        for row in rows:
            self.rows.steps[row] += 1  # this step's query is recorded by the attention hook
        for row in mass_rows:
            self.rows.pending[row] += 1
        # where each request's query of this step goes in the ring (the same for every layer)
        self.step_slots = (torch.tensor(rows, dtype=torch.int64),
                           torch.tensor([(self.rows.steps[r] - 1) % self.rows.window for r in rows]))
        if freed:
            allocator.free(torch.cat(freed).to(torch.int64))
        if not torch.equal(seq_lens, batch.seq_lens_cpu):
            batch.seq_lens_cpu = seq_lens.to(batch.seq_lens_cpu.dtype)
            batch.seq_lens = seq_lens.to(device=batch.seq_lens.device, dtype=batch.seq_lens.dtype)
            batch.seq_lens_sum = None

    def _finish(self, req: Any, cached: int, kept_len: int, protected_after: int, owned_freed: int,
                shared_dropped: int) -> None:
        req.kv.cache_protected_len = protected_after
        req.kv.kv_allocated_len = kept_len
        req.kv.kv_committed_len = kept_len
        req.skip_radix_cache_insert = True
        setattr(req, OFFSET_ATTR, getattr(req, OFFSET_ATTR, 0) + (cached - kept_len))
        STATS.evicted_tokens += cached - kept_len
        STATS.freed_slots += owned_freed
        STATS.dropped_shared_slots += shared_dropped
        STATS.compactions += 1

    def _compact(self, req, row: int, cached: int, kept: torch.Tensor, req_to_token, freed: list) -> int:
        """One kept set for every layer (streaming, ``selection: shared``): the row keeps the chosen slots,
        in order; nothing is copied."""
        kept = kept.cpu()
        slots = req_to_token[row, :cached].clone()
        evicted = torch.ones(cached, dtype=torch.bool)
        evicted[kept] = False
        positions = evicted.nonzero().flatten()
        protected = req.kv.cache_protected_len
        owned = positions[positions >= protected]
        freed.append(slots[owned.to(slots.device)])
        req_to_token[row, :kept.numel()] = slots[kept.to(slots.device)]
        # kept is ascending, so kept tree-owned positions remain a prefix of the row
        self._finish(req, cached, kept.numel(), int((kept < protected).sum()), owned.numel(),
                     positions.numel() - owned.numel())
        return kept.numel()

    def _inputs(self, rows: list[int], slot_matrix: torch.Tensor, cached: int, policy: EvictionPolicy,
                layers: int) -> tuple:
        """What ``policy`` scores for these rows: keys ``[n, layers, h, cached, d]`` of the first ``layers``
        layers, their window queries ``[n, layers, q_heads, w, d]`` and H2O mass ``[n, layers, h, cached]``."""
        pool = self.kv_pool
        keys = self._gather_layers(pool.get_key_buffer, slot_matrix, layers).transpose(2, 3)
        window_queries = mass = None
        if policy.queries_needed:  # the last ``policy.window`` queries of each ring
            window_queries = self.rows.ring_queries(rows)[:, :layers, :, -policy.window:]
        if policy.needs_accumulated:
            shape = (self.rows.ring_layers(pool.layer_num), keys.shape[2])
            mass = torch.stack([self.rows.mass_of(row, cached, shape, keys.device)[:layers] for row in rows])
        return keys, window_queries, mass

    def _gather_layers(self, buffer_of: Callable[[int], torch.Tensor], slot_matrix: torch.Tensor,
                       layers: int) -> torch.Tensor:
        """``[n, layers, cached, h, d]``: the K (or V) buffers of the first ``layers`` layers at
        ``slot_matrix [n, cached]``, each layer gathered straight into one ``[layers, n * cached, h, d]``
        tensor (indexing then stacking would copy everything twice)."""
        first = buffer_of(self.kv_pool.start_layer)
        n, cached = slot_matrix.shape
        flat = slot_matrix.reshape(-1)
        out = torch.empty((layers, n * cached, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for j in range(layers):
            torch.index_select(buffer_of(self.kv_pool.start_layer + j), 0, flat, out=out[j])
        return out.view(layers, n, cached, *first.shape[1:]).transpose(0, 1)

    def _choose(self, group: list, cached: int) -> torch.Tensor:
        """Shared selection for requests of one policy and length: ``[n, budget]`` kept positions."""
        policy, budget = group[0][3], group[0][4].budget
        rows = [row for _, _, row, _, _ in group]
        slot_matrix = torch.stack([self.req_to_token[row, :cached].to(torch.int64) for row in rows])
        inputs = self._inputs(rows, slot_matrix, cached, policy, policy.scored_layers(self.kv_pool.layer_num))
        return policy.select_layers(*inputs[:2], budget, inputs[2], gather_heads=self._gather_heads or None)

    def _rewrite(self, group: list, cached: int, req_to_token, allocator, freed: list, decode_slots: int,
                 tree_cache: Any) -> list[tuple[int, int]]:
        """A set per layer or per KV head, for requests with the same policy and length (scored
        together): copy each layer's kept K/V into request-owned slots. Returns ``(batch index, kept
        length)`` per compressed request; a request without room for its copies waits for the next step."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        policy, budget = group[0][3], group[0][4].budget
        pool = allocator.get_kvcache()
        members = []  # (batch index, req, row, slots, owned, destination, borrowed)
        for i, req, row, _, _ in group:
            slots = req_to_token[row, :cached].to(torch.int64)
            owned = slots[req.kv.cache_protected_len:]
            extra = None
            if owned.numel() < budget:  # a long shared prompt: borrow fresh slots for the kept copies
                need = budget - owned.numel()
                # the radix tree may give back unused cached prefixes; leave the slots the scheduler
                # checked for this decode step (one per running request)
                if allocator.available_size() < need + decode_slots:
                    evict_from_tree_cache(tree_cache, need + decode_slots)
                if allocator.available_size() < need + decode_slots:
                    STATS.skipped_no_room += 1
                    continue  # no room now: stay uncompressed this step, try again next step
                extra = allocator.alloc(need).to(torch.int64)
            destination = owned[:budget] if extra is None else torch.cat([owned, extra])
            members.append((i, req, row, slots, owned, destination, extra is not None))
        if not members:
            return []
        layers = pool.layer_num
        slot_matrix = torch.stack([m[3] for m in members])  # [n, cached]
        member_rows = [m[2] for m in members]
        keys, window_queries, mass = self._inputs(member_rows, slot_matrix, cached, policy, layers)
        kept = policy.select_layers(keys, window_queries, budget, mass, gather_heads=self._gather_heads or None)
        destinations = torch.stack([m[5] for m in members])  # [n, budget]
        if kept.dim() == 3:  # [n, layers, budget]: one set per layer, copied slot to slot
            sources = slot_matrix.unsqueeze(1).expand(-1, layers, -1).gather(2, kept)  # [n, layers, budget]
            for j in range(layers):
                for buffer in (pool.get_key_buffer(pool.start_layer + j), pool.get_value_buffer(pool.start_layer + j)):
                    buffer[destinations] = buffer[sources[:, j]]  # read first: sources overlap destinations
            kept = kept.unsqueeze(2).expand(-1, -1, keys.shape[2], -1)
        else:  # [n, layers, h, budget]: a set per KV head
            values = self._gather_layers(pool.get_value_buffer, slot_matrix, layers).transpose(2, 3)
            index = kept.unsqueeze(-1).expand(-1, -1, -1, -1, keys.shape[-1])  # [n, layers, h, budget, d]
            new_keys = keys.gather(3, index).transpose(2, 3)  # [n, layers, budget, h, d]
            new_values = values.gather(3, index).transpose(2, 3)
            for j in range(layers):
                pool.get_key_buffer(pool.start_layer + j)[destinations] = new_keys[:, j]
                pool.get_value_buffer(pool.start_layer + j)[destinations] = new_values[:, j]
        done = []
        for m, (i, req, row, slots, owned, destination, borrowed) in enumerate(members):
            if row in self.rows.mass:
                self.rows.keep_mass_at(row, kept[m, :self.rows.mass[row].shape[0]])
            protected = req.kv.cache_protected_len
            freed.append(owned[:0] if borrowed else owned[budget:])
            req_to_token[row, :budget] = destination.to(req_to_token.dtype)
            STATS.copied_tokens += budget
            self._finish(req, cached, budget, 0, max(owned.numel() - budget, 0), protected)
            done.append((i, budget))
        return done

    def _add_pending_mass(self, members: list[tuple[int, int]]) -> None:
        """H2O: add the attention the rows' pending recorded queries paid to their cached keys, every
        recorded layer in one batched pass. ``members``: ``(row, cached length)``."""
        pool, req_to_token = self.kv_pool, self.req_to_token
        rows = [row for row, _ in members]
        lengths = torch.tensor([cached for _, cached in members], device=req_to_token.device)
        counts = torch.tensor([self.rows.pending[row] for row in rows], device=req_to_token.device)
        width = int(lengths.max())
        slots = req_to_token[rows, :width].to(torch.int64).clamp(min=0)  # stale entries past a length are masked
        layers = self.rows.ring_layers(pool.layer_num)
        keys = self._gather_layers(pool.get_key_buffer, slots, layers)  # [n, layers, width, h, d]
        queries = self.rows.ring_queries(rows)  # [n, layers, q_heads, window, d]
        n = len(rows)
        mass = window_attention_mass(keys.flatten(0, 1).transpose(1, 2), queries.flatten(0, 1), self.scaling,
                                     lengths.repeat_interleave(layers), counts.repeat_interleave(layers))
        mass = mass.unflatten(0, (n, layers))  # [n, layers, h, width]
        for r, (row, cached) in enumerate(members):
            self.rows.mass_of(row, cached, mass.shape[1:3], mass.device).add_(mass[r, ..., :cached])
            self.rows.pending[row] = 0

    # ------------------------------------------------------------------ hooks on the model side
    def record(self, layer, q: torch.Tensor, forward_batch) -> None:
        """Decode step, before attention: store this step's query per request row (ring layers only)."""
        pool = self.kv_pool
        layer_index = layer.layer_id - pool.start_layer
        if not self.rows.keep_queries or layer_index >= self.rows.ring_layers(pool.layer_num):
            return
        rows, positions = self.step_slots
        q = q.view(rows.numel(), layer.tp_q_head_num, -1)
        self.scaling = layer.scaling
        self.rows.ensure_queries(self.req_to_token.shape[0], pool.layer_num, layer.tp_q_head_num, q.shape[-1],
                                 q.dtype, q.device)
        self.rows.queries[rows, layer_index, positions] = q.detach()


def kv_pool_allocation(scheduler: Any) -> dict:
    """What SGLang allocated for the KV pool: bytes of its K and V buffers and their rows (token
    slots, including the padding slots SGLang adds); compared with tools/launch.py --plan."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    size = pool.get_kv_size_bytes()
    buffers = getattr(pool, "k_buffer", None)
    rows = int(buffers[0].shape[0]) if isinstance(buffers, (list, tuple)) and buffers else None
    return {"kv_pool_bytes": int(sum(size) if isinstance(size, (tuple, list)) else size), "kv_pool_rows": rows}


def install(settings: EngineKVSettings) -> None:
    """Hook decode allocation (compression, H2O's attention mass, pool statistics), decode positions,
    the attention layer (query recording), retraction and the scheduler's internal state."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController
    from sglang.srt.mem_cache import allocation
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    compressor = Compressor(settings) if settings.enabled or settings.allow_request_override else None
    default_alloc = allocation.alloc_for_decode_default

    def alloc_for_decode(batch, token_per_req):
        if compressor is not None:
            started = time.perf_counter()
            compressor(batch)
            STATS.compress_seconds += time.perf_counter() - started
        out_cache_loc = default_alloc(batch, token_per_req)
        STATS.observe_pool(batch.tree_cache.token_to_kv_pool_allocator)
        return out_cache_loc

    for device in ("cpu", "cuda"):
        allocation.ALLOC_FOR_DECODE_FUNCS[device] = alloc_for_decode

    if compressor is not None:
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

        if compressor.rows.keep_queries:
            original_forward = RadixAttention.forward

            def forward(self, q, k, v, forward_batch, *args, **kwargs):
                if forward_batch.forward_mode.is_decode():
                    started = time.perf_counter()
                    compressor.record(self, q, forward_batch)
                    STATS.hook_seconds += time.perf_counter() - started
                return original_forward(self, q, k, v, forward_batch, *args, **kwargs)

            RadixAttention.forward = forward

        original_reset = Req.reset_for_retract

        def reset_for_retract(self):
            # the KV is recomputed densely from the prompt and the output so far: start over
            setattr(self, OFFSET_ATTR, 0)
            setattr(self, RETRACTIONS_ATTR, getattr(self, RETRACTIONS_ATTR, 0) + 1)
            STATS.retractions += 1
            return original_reset(self)

        Req.reset_for_retract = reset_for_retract

        if settings.compressed_admission:
            from sglang_patches import admission

            admission.install(compressor.settings_for)

    original_state = SchedulerInternalStateController.get_internal_state

    def get_internal_state(self, recv_req):
        output = original_state(self, recv_req)
        output.internal_state["sparse_rl_kv"] = {"settings": settings.to_dict(), **STATS.read_and_reset_peak(),
                                                 **kv_pool_allocation(self.scheduler)}
        return output

    SchedulerInternalStateController.get_internal_state = get_internal_state
    logger.info("sparse_rl_mega KV patch installed: %s", settings)
