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
without CUDA graphs (``sparse_rl_mega.kv.engine_settings.cuda_graphs_allowed``).

Needs ``page_size=1``, the non-overlap scheduler and no speculative decoding (the engine factory in
``sparse_rl_mega.rollout.engine`` sets these). Everything of SGLang is reached through
``sparse_rl_mega.rollout.sglang_internals`` (requests, the batch, the pool, the hooks).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Optional
from collections.abc import Callable

import torch

from sglang_patches import admission
from sparse_rl_mega.kv import EvictionPolicy, build_policy, should_compress
from sparse_rl_mega.kv.attention_mass import window_attention_mass
from sparse_rl_mega.kv.engine_settings import (MASS_HEADROOM, REQUEST_KEY, EngineKVSettings, records_queries,
                                               ring_layers, scoring_bytes_per_request, scoring_chunk)
from sparse_rl_mega.rollout import sglang_internals as sglang

logger = logging.getLogger("sparse_rl_mega.sglang_patches")


class EngineKVStats:
    """Counters since engine start, plus the peak pool use since the last read."""

    def __init__(self) -> None:
        self.compactions = self.evicted_tokens = self.freed_slots = self.dropped_shared_slots = 0
        self.copied_tokens = self.skipped_no_room = self.retractions = 0
        self.decode_steps = 0  # decode batches run (a caller can see a generation progress)
        # wall time spent in this patch: before decode steps (compression, H2O's attention mass) and in
        # the attention hook (query recording); the benchmark reports them next to the run time
        self.compress_seconds = self.hook_seconds = 0.0
        self.peak_slots_in_use = 0
        # the most KV slots one request held in a decode step (after its compression, with the step's
        # token) since the last read: what each request's memory came to
        self.peak_request_tokens = 0
        self.pool_size = 0
        # side buffers beside SGLang's pool: the decode-query ring (allocated once) and H2O's per-request
        # attention mass (now and at its peak)
        self.query_ring_bytes = self.h2o_mass_bytes = self.h2o_mass_peak_bytes = 0

    def observe_mass(self, buffers) -> None:
        self.h2o_mass_bytes = sum(t.numel() * t.element_size() for t in buffers)
        self.h2o_mass_peak_bytes = max(self.h2o_mass_peak_bytes, self.h2o_mass_bytes)

    def observe_pool(self, pool: sglang.KVPool) -> None:  # (after every decode step's allocation)
        self.decode_steps += 1
        self.pool_size = pool.size
        self.peak_slots_in_use = max(self.peak_slots_in_use, self.pool_size - pool.available())

    def read_and_reset_peak(self) -> dict:
        out = dict(vars(self))
        self.peak_slots_in_use = 0
        self.peak_request_tokens = 0
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

    def claim(self, row: int, request: sglang.Request) -> None:
        key = request.identity
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


@dataclass
class Due:
    """A request to compress at this decode step."""
    index: int                  # in the batch
    request: sglang.Request
    row: int                    # of req_to_token
    settings: EngineKVSettings
    policy: EvictionPolicy


@dataclass
class Rewrite:
    """A request whose kept K/V (a set per layer or head) are copied into ``destination`` slots."""
    due: Due
    slots: torch.Tensor         # [cached] its row's slots
    owned: torch.Tensor         # the slots it owns (past the tree's protected prefix)
    destination: torch.Tensor   # [budget] where the kept K/V go
    borrowed: bool              # destination holds fresh slots (a long shared prompt left too few owned)


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
        self._gather_heads: object = False  # resolved at the first compression (the TP group exists then)
        # the scheduler and the model runner share one process (non-overlap, TP per process):
        # the attention hooks reach the pool through these references, set at each decode step
        self.req_to_token: Optional[torch.Tensor] = None
        self.pool: Optional[sglang.KVPool] = None
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

    def plan_for(self, request: sglang.Request) -> tuple[EngineKVSettings, Optional[EvictionPolicy]]:
        """The request's settings (the engine's, updated by its ``custom_params["sparse_rl_kv"]`` if
        allowed) and policy (None when off). Resolved once per request: they never change, and the
        scheduler asks for them every decode step and every admission decision."""
        plan = request.plan
        if plan is None:
            override = request.custom_params.get(REQUEST_KEY)
            if override and self.settings.refusal(override):  # (the trainer checks before it sends)
                override = None
            settings = self.settings.updated(override) if override else self.settings
            plan = request.plan = (settings, self.policy_for(settings) if settings.enabled else None)
        return plan

    def settings_for(self, request: sglang.Request) -> EngineKVSettings:
        return self.plan_for(request)[0]

    def __call__(self, batch: sglang.DecodeBatch) -> None:
        if not batch.requests:
            return
        self.req_to_token, self.pool = batch.req_to_token, batch.pool
        if self._gather_heads is False:
            self._gather_heads = sglang.tp_head_gather()
        self.rows.drop_mass_except({request.row for request in batch.requests})  # finished requests' mass
        seq_lens = batch.seq_lens().clone()
        lengths = seq_lens.tolist()
        freed: list[torch.Tensor] = []
        scoring: dict[tuple, list[Due]] = {}  # (policy, cached length) -> requests to compress together
        mass_rows: list[int] = []  # H2O rows: their next query goes into the mass
        add_mass: list[tuple[int, int]] = []  # (row, cached length): add the ring's pending queries now
        for i, request in enumerate(batch.requests):
            row = request.row
            self.rows.claim(row, request)
            settings, policy = self.plan_for(request)
            cached = lengths[i]
            if policy is None:
                continue
            at_newline = bool(settings.newline_token_ids) and request.last_output_token in settings.newline_token_ids
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
                seq_lens[i] = self._compact(request, cached, kept, freed)
            else:
                scoring.setdefault((id(policy), cached), []).append(Due(i, request, row, settings, policy))
        if add_mass:
            self._add_pending_mass(add_mass)
        pool = self.pool
        for (_, cached), group in scoring.items():
            # all samples of a GRPO group reach the trigger at the same step: score them in chunks within
            # the settings' scoring_workspace_bytes (the same chunks on every TP rank)
            key_buffer, settings = pool.keys(0), group[0].settings
            chunk = scoring_chunk(settings, scoring_bytes_per_request(
                settings, layers=pool.layers, kv_heads=key_buffer.shape[1], head_dim=key_buffer.shape[2],
                dtype_bytes=key_buffer.element_size(), length=cached))
            for part in (group[k:k + chunk] for k in range(0, len(group), chunk)):
                if part[0].policy.shared:
                    for due, kept in zip(part, self._choose(part, cached)):
                        seq_lens[due.index] = self._compact(due.request, cached, kept, freed)
                        if due.row in self.rows.mass:
                            self.rows.keep_mass_at(due.row, kept[None, None])
                else:
                    for i, kept_len in self._rewrite(part, cached, freed, decode_slots=len(batch.requests)):
                        seq_lens[i] = kept_len
        rows = [request.row for request in batch.requests]
        for row in rows:
            self.rows.steps[row] += 1  # this step's query is recorded by the attention hook
        for row in mass_rows:
            self.rows.pending[row] += 1
        # where each request's query of this step goes in the ring (the same for every layer), made once
        # per step on the ring's device: CPU indices into a CUDA ring would be copied in every layer's hook
        slots = torch.tensor([rows, [(self.rows.steps[r] - 1) % self.rows.window for r in rows]], dtype=torch.int64)
        self.step_slots = tuple(slots.to(self.req_to_token.device).unbind())
        if freed:
            pool.free(torch.cat(freed).to(torch.int64))
        batch.set_seq_lens(seq_lens)
        STATS.peak_request_tokens = max(STATS.peak_request_tokens, int(seq_lens.max()) + 1)

    @staticmethod
    def _finish(request: sglang.Request, cached: int, kept_len: int, protected_after: int, owned_freed: int,
                shared_dropped: int) -> None:
        request.set_compressed(kept_len, protected_after)
        request.evicted_positions += cached - kept_len
        STATS.evicted_tokens += cached - kept_len
        STATS.freed_slots += owned_freed
        STATS.dropped_shared_slots += shared_dropped
        STATS.compactions += 1

    def _compact(self, request: sglang.Request, cached: int, kept: torch.Tensor, freed: list) -> int:
        """One kept set for every layer (streaming, ``selection: shared``): the row keeps the chosen slots,
        in order; nothing is copied."""
        kept = kept.cpu()
        row, req_to_token = request.row, self.req_to_token
        slots = req_to_token[row, :cached].clone()
        evicted = torch.ones(cached, dtype=torch.bool)
        evicted[kept] = False
        positions = evicted.nonzero().flatten()
        protected = request.protected
        owned = positions[positions >= protected]
        freed.append(slots[owned.to(slots.device)])
        req_to_token[row, :kept.numel()] = slots[kept.to(slots.device)]
        # kept is ascending, so kept tree-owned positions remain a prefix of the row
        self._finish(request, cached, kept.numel(), int((kept < protected).sum()), owned.numel(),
                     positions.numel() - owned.numel())
        return kept.numel()

    def _inputs(self, rows: list[int], slot_matrix: torch.Tensor, cached: int, policy: EvictionPolicy,
                layers: int) -> tuple:
        """What ``policy`` scores for these rows: keys ``[n, layers, h, cached, d]`` of the first ``layers``
        layers, their window queries ``[n, layers, q_heads, w, d]`` and H2O mass ``[n, layers, h, cached]``."""
        keys = self._gather_layers(self.pool.keys, slot_matrix, layers).transpose(2, 3)
        window_queries = mass = None
        if policy.queries_needed:  # the last ``policy.window`` queries of each ring
            window_queries = self.rows.ring_queries(rows)[:, :layers, :, -policy.window:]
        if policy.needs_accumulated:
            shape = (self.rows.ring_layers(self.pool.layers), keys.shape[2])
            mass = torch.stack([self.rows.mass_of(row, cached, shape, keys.device)[:layers] for row in rows])
        return keys, window_queries, mass

    def _gather_layers(self, buffer_of: Callable[[int], torch.Tensor], slot_matrix: torch.Tensor,
                       layers: int) -> torch.Tensor:
        """``[n, layers, cached, h, d]``: the K (or V) buffers of the first ``layers`` layers at
        ``slot_matrix [n, cached]``, each layer gathered straight into one ``[layers, n * cached, h, d]``
        tensor (indexing then stacking would copy everything twice)."""
        first = buffer_of(0)
        n, cached = slot_matrix.shape
        flat = slot_matrix.reshape(-1)
        out = torch.empty((layers, n * cached, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for j in range(layers):
            torch.index_select(buffer_of(j), 0, flat, out=out[j])
        return out.view(layers, n, cached, *first.shape[1:]).transpose(0, 1)

    def _choose(self, group: list[Due], cached: int) -> torch.Tensor:
        """Shared selection for requests of one policy and length: ``[n, budget]`` kept positions."""
        policy, budget = group[0].policy, group[0].settings.budget
        rows = [due.row for due in group]
        slot_matrix = torch.stack([self.req_to_token[row, :cached].to(torch.int64) for row in rows])
        inputs = self._inputs(rows, slot_matrix, cached, policy, policy.scored_layers(self.pool.layers))
        return policy.select_layers(*inputs[:2], budget, inputs[2], gather_heads=self._gather_heads or None)

    def _rewrite(self, group: list[Due], cached: int, freed: list, decode_slots: int) -> list[tuple[int, int]]:
        """A set per layer or per KV head, for requests with the same policy and length (scored
        together): copy each layer's kept K/V into request-owned slots. Returns ``(batch index, kept
        length)`` per compressed request; a request without room for its copies waits for the next step."""
        policy, budget = group[0].policy, group[0].settings.budget
        pool, req_to_token = self.pool, self.req_to_token
        members: list[Rewrite] = []
        for due in group:
            slots = req_to_token[due.row, :cached].to(torch.int64)
            owned = slots[due.request.protected:]
            extra = None
            if owned.numel() < budget:  # a long shared prompt: borrow fresh slots for the kept copies
                need = budget - owned.numel()
                # the radix tree may give back unused cached prefixes; leave the slots the scheduler
                # checked for this decode step (one per running request)
                if pool.available() < need + decode_slots:
                    pool.evict_from_tree(need + decode_slots)
                if pool.available() < need + decode_slots:
                    STATS.skipped_no_room += 1
                    continue  # no room now: stay uncompressed this step, try again next step
                extra = pool.alloc(need).to(torch.int64)
            destination = owned[:budget] if extra is None else torch.cat([owned, extra])
            members.append(Rewrite(due, slots, owned, destination, extra is not None))
        if not members:
            return []
        layers = pool.layers
        slot_matrix = torch.stack([m.slots for m in members])  # [n, cached]
        member_rows = [m.due.row for m in members]
        keys, window_queries, mass = self._inputs(member_rows, slot_matrix, cached, policy, layers)
        kept = policy.select_layers(keys, window_queries, budget, mass, gather_heads=self._gather_heads or None)
        destinations = torch.stack([m.destination for m in members])  # [n, budget]
        if kept.dim() == 3:  # [n, layers, budget]: one set per layer, copied slot to slot
            sources = slot_matrix.unsqueeze(1).expand(-1, layers, -1).gather(2, kept)  # [n, layers, budget]
            for j in range(layers):
                for buffer in (pool.keys(j), pool.values(j)):
                    buffer[destinations] = buffer[sources[:, j]]  # read first: sources overlap destinations
            kept = kept.unsqueeze(2).expand(-1, -1, keys.shape[2], -1)
        else:  # [n, layers, h, budget]: a set per KV head
            values = self._gather_layers(pool.values, slot_matrix, layers).transpose(2, 3)
            index = kept.unsqueeze(-1).expand(-1, -1, -1, -1, keys.shape[-1])  # [n, layers, h, budget, d]
            new_keys = keys.gather(3, index).transpose(2, 3)  # [n, layers, budget, h, d]
            new_values = values.gather(3, index).transpose(2, 3)
            for j in range(layers):
                pool.keys(j)[destinations] = new_keys[:, j]
                pool.values(j)[destinations] = new_values[:, j]
        done = []
        for m, member in enumerate(members):
            row = member.due.row
            if row in self.rows.mass:
                self.rows.keep_mass_at(row, kept[m, :self.rows.mass[row].shape[0]])
            protected = member.due.request.protected
            freed.append(member.owned[:0] if member.borrowed else member.owned[budget:])
            req_to_token[row, :budget] = member.destination.to(req_to_token.dtype)
            STATS.copied_tokens += budget
            self._finish(member.due.request, cached, budget, 0, max(member.owned.numel() - budget, 0), protected)
            done.append((member.due.index, budget))
        return done

    def _add_pending_mass(self, members: list[tuple[int, int]]) -> None:
        """H2O: add the attention the rows' pending recorded queries paid to their cached keys, every
        recorded layer in one batched pass. ``members``: ``(row, cached length)``."""
        pool, req_to_token = self.pool, self.req_to_token
        rows = [row for row, _ in members]
        lengths = torch.tensor([cached for _, cached in members], device=req_to_token.device)
        counts = torch.tensor([self.rows.pending[row] for row in rows], device=req_to_token.device)
        width = int(lengths.max())
        slots = req_to_token[rows, :width].to(torch.int64).clamp(min=0)  # stale entries past a length are masked
        layers = self.rows.ring_layers(pool.layers)
        keys = self._gather_layers(pool.keys, slots, layers)  # [n, layers, width, h, d]
        queries = self.rows.ring_queries(rows)  # [n, layers, q_heads, window, d]
        n = len(rows)
        mass = window_attention_mass(keys.flatten(0, 1).transpose(1, 2), queries.flatten(0, 1), self.scaling,
                                     lengths.repeat_interleave(layers), counts.repeat_interleave(layers))
        mass = mass.unflatten(0, (n, layers))  # [n, layers, h, width]
        for r, (row, cached) in enumerate(members):
            self.rows.mass_of(row, cached, mass.shape[1:3], mass.device).add_(mass[r, ..., :cached])
            self.rows.pending[row] = 0

    # ------------------------------------------------------------------ hooks on the model side
    def record(self, layer_id: int, q_heads: int, scaling: float, q: torch.Tensor) -> None:
        """Decode step, before attention: store this step's query per request row (ring layers only)."""
        pool = self.pool
        layer_index = pool.layer_index(layer_id)
        if not self.rows.keep_queries or layer_index >= self.rows.ring_layers(pool.layers):
            return
        rows, positions = self.step_slots
        q = q.view(rows.numel(), q_heads, -1)
        self.scaling = scaling
        self.rows.ensure_queries(self.req_to_token.shape[0], pool.layers, q_heads, q.shape[-1], q.dtype, q.device)
        self.rows.queries[rows, layer_index, positions] = q.detach()


def install(settings: EngineKVSettings, after_compress: Optional[Callable[[sglang.DecodeBatch], None]] = None) -> None:
    """Hook decode allocation (compression, H2O's attention mass, pool statistics), decode positions,
    the attention layer (query recording), retraction, admission and the scheduler's internal state.
    ``after_compress(batch)``: after each step's compression (``sglang_patches.metadata_check``)."""
    compressor = Compressor(settings) if settings.enabled or settings.allow_request_override else None

    def before_decode(batch: sglang.DecodeBatch) -> None:
        started = time.perf_counter()
        compressor(batch)
        STATS.compress_seconds += time.perf_counter() - started
        if after_compress is not None:
            after_compress(batch)

    sglang.hook_decode_allocation(before_decode if compressor is not None else None, STATS.observe_pool)

    if compressor is not None:
        sglang.hook_decode_positions()

        if compressor.rows.keep_queries:
            def record(layer_id: int, q_heads: int, scaling: float, q: torch.Tensor) -> None:
                started = time.perf_counter()
                compressor.record(layer_id, q_heads, scaling, q)
                STATS.hook_seconds += time.perf_counter() - started

            sglang.hook_decode_attention(record)

        def on_retract(request: sglang.Request) -> None:
            # the KV is recomputed densely from the prompt and the output so far: start over
            request.evicted_positions = 0
            request.retractions += 1
            STATS.retractions += 1

        sglang.hook_retraction(on_retract)

        if settings.compressed_admission:
            admission.install(compressor.settings_for)

    sglang.hook_cached_prefix_drop()
    sglang.hook_internal_state("sparse_rl_kv", lambda pool: {"settings": settings.to_dict(),
                                                             **STATS.read_and_reset_peak(), **pool.allocation()})
    logger.info("sparse_rl_mega KV patch installed: %s", settings)
