"""Everything sparse-rl-mega reaches inside SGLang, in one module, for the one SGLang it was written for.

This is the only module that imports ``sglang.srt`` or reads and writes SGLang's internal attributes.
The patch's logic (``kv_eviction``, ``admission``) and the trainer's engine (``rollout/engine.py``) go
through what it offers:

* :func:`check_version`: the patch replaces internals that change between SGLang releases, so another
  version is refused with one line, in the trainer before an engine starts and in every SGLang process
  before anything is installed;
* views of the scheduler's objects: :class:`Request` (a request's row, protected and committed lengths,
  its output, the patch's own state on it), :class:`DecodeBatch` (the batch about to decode) and
  :class:`KVPool` (a layer's K/V buffers, slot allocation and freeing, the radix tree's eviction);
* the hooks, each replacing one SGLang callable and calling the patch back: decode allocation, decode
  positions, the attention layer, retraction, the scheduler's internal state, admission, sampling
  seeds, weight loading (CPU) and its progress bars; and one scheduler method the patch adds (the drop
  of cached prefixes no request holds);
* on the trainer's side: the engine's calls as coroutines on its event loop (generation with sampling
  supports, cache keys and per-token weight versions; weight updates; pause and continue; the drop of
  unused cached prefixes over the scheduler's RPC socket), its subprocess watchdog, when it last
  answered, the shared-memory files it leaves (named before it starts), and the module whose process
  starts it uses.

Written against SGLang 0.5.23 (file and line references below are to that release).
"""
from __future__ import annotations

import asyncio
import logging
import os
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional
from collections.abc import Callable, Iterable

import torch

logger = logging.getLogger("sparse_rl_mega.sglang_patches")

SGLANG_VERSION = "0.5.23"
SHM_DIR = "/dev/shm"


class SGLangVersionError(RuntimeError):
    """The installed SGLang is not the one the patch was written for."""


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "none"


def check_version(installed: Optional[str] = None) -> None:
    """Refuse any SGLang but :data:`SGLANG_VERSION` (``installed``: the version found; default: the
    installed package's) with one line naming both."""
    found = installed if installed is not None else installed_version()
    if found != SGLANG_VERSION:
        raise SGLangVersionError(
            f"sparse-rl-mega's SGLang patch (sglang_patches/) is written for sglang {SGLANG_VERSION}, and sglang "
            f"{found} is installed: install sglang=={SGLANG_VERSION} (the patch replaces SGLang internals "
            "that change between releases)")


# ----------------------------------------------------------------------------- views of the scheduler

# the patch's own state, kept on SGLang's request object (it lives exactly as long as the request)
_EVICTED_POSITIONS = "_sparse_rl_evicted_positions"
_PLAN = "_sparse_rl_kv_plan"
_RETRACTIONS = "_sparse_rl_retractions"


class Request:
    """One scheduler request (``schedule_batch.Req``) as the patch sees it."""
    __slots__ = ("req",)

    def __init__(self, req: Any):
        self.req = req

    @property
    def identity(self) -> tuple:
        """Unique for the request and each of its retractions (unlike ``id()`` of a freed object)."""
        return self.req.rid, self.retractions

    @property
    def row(self) -> Optional[int]:
        """Its row of ``req_to_token`` (None before it is admitted)."""
        return self.req.kv.req_pool_idx

    @property
    def protected(self) -> int:
        """Its first positions, whose slots the radix tree owns (a shared prompt)."""
        return self.req.kv.cache_protected_len

    @property
    def allocated(self) -> int:
        """Positions of its row holding a slot."""
        return self.req.kv.kv_allocated_len

    @property
    def output_len(self) -> int:
        return len(self.req.output_ids)

    @property
    def last_output_token(self) -> Optional[int]:
        return self.req.output_ids[-1] if self.req.output_ids else None

    @property
    def custom_params(self) -> dict:
        return getattr(self.req.sampling_params, "custom_params", None) or {}

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.req.sampling_params.max_new_tokens

    @max_new_tokens.setter
    def max_new_tokens(self, value: int) -> None:
        self.req.sampling_params.max_new_tokens = value

    def set_compressed(self, kept_len: int, protected: int) -> None:
        """Its row now holds ``kept_len`` positions, the first ``protected`` owned by the radix tree; the
        compressed row must never be inserted into the tree."""
        self.req.kv.cache_protected_len = protected
        self.req.kv.kv_allocated_len = kept_len
        self.req.kv.kv_committed_len = kept_len
        self.req.skip_radix_cache_insert = True

    # the patch's state
    @property
    def evicted_positions(self) -> int:
        """Positions evicted so far: added to its decode positions, so that RoPE sees logical ones."""
        return getattr(self.req, _EVICTED_POSITIONS, 0)

    @evicted_positions.setter
    def evicted_positions(self, value: int) -> None:
        setattr(self.req, _EVICTED_POSITIONS, value)

    @property
    def retractions(self) -> int:
        return getattr(self.req, _RETRACTIONS, 0)

    @retractions.setter
    def retractions(self, value: int) -> None:
        setattr(self.req, _RETRACTIONS, value)

    @property
    def plan(self) -> Any:
        """What the patch resolved for it once (its KV settings and policy), or None."""
        return getattr(self.req, _PLAN, None)

    @plan.setter
    def plan(self, value: Any) -> None:
        setattr(self.req, _PLAN, value)


class KVPool:
    """The KV pool of one scheduler (one TP rank): its layers' K/V buffers and its slot allocator."""

    def __init__(self, allocator: Any, tree_cache: Any = None):
        self.allocator, self.tree_cache = allocator, tree_cache
        self._kv = allocator.get_kvcache()

    @property
    def layers(self) -> int:
        """Layers held here (a pipeline stage's, at SGLang's PP > 1)."""
        return self._kv.layer_num

    def keys(self, layer: int) -> torch.Tensor:
        """K of the pool's ``layer``-th layer: ``[slots, kv_heads, head_dim]``, post-RoPE."""
        return self._kv.get_key_buffer(self._kv.start_layer + layer)

    def values(self, layer: int) -> torch.Tensor:
        return self._kv.get_value_buffer(self._kv.start_layer + layer)

    def layer_index(self, layer_id: int) -> int:
        """The pool's index of the model's layer ``layer_id``."""
        return layer_id - self._kv.start_layer

    @property
    def size(self) -> int:
        return int(self.allocator.size)

    def available(self) -> int:
        return int(self.allocator.available_size())

    def alloc(self, n: int) -> torch.Tensor:
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def evict_from_tree(self, n: int) -> None:
        """Let the radix tree give back up to ``n`` slots of cached prefixes no request uses."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        evict_from_tree_cache(self.tree_cache, n)

    def allocation(self) -> dict:
        """What SGLang allocated: bytes of the K and V buffers and their rows (token slots, with the
        padding slots SGLang adds); compared with tools/launch.py --plan."""
        size = self._kv.get_kv_size_bytes()
        buffers = getattr(self._kv, "k_buffer", None)
        rows = int(buffers[0].shape[0]) if isinstance(buffers, (list, tuple)) and buffers else None
        return {"kv_pool_bytes": int(sum(size) if isinstance(size, (tuple, list)) else size), "kv_pool_rows": rows}


class DecodeBatch:
    """The scheduler's batch about to run a decode step (``ScheduleBatch``)."""

    def __init__(self, batch: Any):
        self._batch = batch
        self.requests = [Request(req) for req in batch.reqs]
        self.req_to_token: torch.Tensor = batch.req_to_token_pool.req_to_token  # [rows, context] slot per position
        self.pool = KVPool(batch.tree_cache.token_to_kv_pool_allocator, batch.tree_cache)

    def seq_lens(self) -> torch.Tensor:
        """Cached length of each request (CPU)."""
        return self._batch.seq_lens_cpu

    def set_seq_lens(self, seq_lens: torch.Tensor) -> None:
        """New cached lengths (after compressions), on the CPU and the device copy."""
        batch = self._batch
        if not torch.equal(seq_lens, batch.seq_lens_cpu):
            batch.seq_lens_cpu = seq_lens.to(batch.seq_lens_cpu.dtype)
            batch.seq_lens = seq_lens.to(device=batch.seq_lens.device, dtype=batch.seq_lens.dtype)
            batch.seq_lens_sum = None


def tp_head_gather() -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """With engine TP > 1: a function that all-gathers per-head scores ``[..., local_heads, M]`` (head
    axis 2) over SGLang's TP group into every head in model order (rank r holds heads
    ``r * local .. (r + 1) * local - 1``). ``None`` at TP 1."""
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


# ----------------------------------------------------------------------------- hooks in the scheduler


def hook_scheduler_built(check: Callable[[dict], None]) -> None:
    """``check(resolved)`` in each scheduler once SGLang built it, before it takes a request, with what it
    really runs: ``page_size`` (its KV allocator's), ``attention_backends`` (prefill, decode: its model
    runner's), ``sampling_backend``, ``overlap`` (the overlap scheduler runs), ``speculative`` (the
    algorithm's name, or None) and ``decode_cuda_graph_bs`` (the batch sizes its decode CUDA graphs
    were captured for; empty: none, the model runner captures them as it is built). SGLang resolves
    these inside the engine (``srt/arg_groups/overrides.py`` may replace a requested page size by 64 or
    128 for some backends), not in the caller's ``ServerArgs``. An exception from ``check`` fails the
    scheduler's start (SGLang logs it and signals the engine). The dict is kept on the scheduler and
    reported in its internal state (:func:`hook_internal_state`, key ``resolved``)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_exec

    original_init = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        runner = self.tp_worker.model_runner
        self.sparse_rl_resolved = {
            "page_size": self.token_to_kv_pool_allocator.page_size,
            "attention_backends": (runner.prefill_attention_backend_str, runner.decode_attention_backend_str),
            "sampling_backend": get_exec().kernel.sampling_backend, "overlap": bool(self.enable_overlap),
            "speculative": None if self.spec_algorithm.is_none() else self.spec_algorithm.name,
            "decode_cuda_graph_bs": list(runner.decode_cuda_graph_capture_bs)}
        check(self.sparse_rl_resolved)

    Scheduler.__init__ = __init__


def hook_decode_allocation(before: Optional[Callable[[DecodeBatch], None]], after: Callable[[KVPool], None]) -> None:
    """``before(batch)`` (if given) runs before each decode step allocates its slots
    (``mem_cache/allocation.py``: ``alloc_for_decode``), ``after(pool)`` right after."""
    from sglang.srt.mem_cache import allocation

    default_alloc = allocation.alloc_for_decode_default

    def alloc_for_decode(batch, token_per_req):
        if before is not None:
            before(DecodeBatch(batch))
        out_cache_loc = default_alloc(batch, token_per_req)
        tree_cache = batch.tree_cache
        after(KVPool(tree_cache.token_to_kv_pool_allocator, tree_cache))
        return out_cache_loc

    for device in ("cpu", "cuda"):
        allocation.ALLOC_FOR_DECODE_FUNCS[device] = alloc_for_decode


def hook_decode_positions() -> None:
    """Decode positions of a request count its evicted positions (:attr:`Request.evicted_positions`):
    kept keys were stored already rotated, so new tokens must take their logical positions."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    original_init_new = ForwardBatch.init_new.__func__

    def init_new(cls, batch, model_runner, **kwargs):
        forward_batch = original_init_new(cls, batch, model_runner, **kwargs)
        if forward_batch.forward_mode.is_decode() and batch.reqs:
            offsets = [Request(req).evicted_positions for req in batch.reqs]
            if any(offsets):
                forward_batch.positions = forward_batch.positions + torch.tensor(
                    offsets, dtype=forward_batch.positions.dtype, device=forward_batch.positions.device)
        return forward_batch

    ForwardBatch.init_new = classmethod(init_new)


def hook_decode_attention(record: Callable[[int, int, float, torch.Tensor], None]) -> None:
    """``record(layer_id, q_heads, scaling, q)`` before each decode step's attention of every layer
    (``RadixAttention.forward``): ``q`` ``[requests, q_heads * head_dim]`` post-RoPE, this TP rank's
    ``q_heads``. Python in the step: GPU engines with it run without CUDA graphs."""
    from sglang.srt.layers.radix_attention import RadixAttention

    original_forward = RadixAttention.forward

    def forward(self, q, k, v, forward_batch, *args, **kwargs):
        if forward_batch.forward_mode.is_decode():
            record(self.layer_id, self.tp_q_head_num, self.scaling, q)
        return original_forward(self, q, k, v, forward_batch, *args, **kwargs)

    RadixAttention.forward = forward


class DecodeMetadata:
    """One decode step's attention inputs once the decode backend built them (``init_forward_metadata``):
    what its kernels will read for each request, the batch's lengths, the requests' own token counts and
    the allocator's free slots (``hook_decode_metadata``). Lists have one entry per request."""

    def __init__(self, runner: Any, forward_batch: Any, token_counts: list[int]):
        self._runner, self._batch = runner, forward_batch
        self.backend = runner.decode_attention_backend_str
        self.rows: list[int] = forward_batch.req_pool_indices.tolist()
        self.seq_lens: list[int] = forward_batch.seq_lens.tolist()  # (the device copy, which kernels read)
        cpu = forward_batch.seq_lens_cpu
        self.seq_lens_cpu: Optional[list[int]] = None if cpu is None else cpu.tolist()
        self.seq_lens_sum: Optional[int] = forward_batch.seq_lens_sum
        self.token_counts = token_counts  # prompt + output tokens - evicted positions (the scheduler's requests)
        self.new_slots: list[int] = forward_batch.out_cache_loc.tolist()  # this step's token, per request

    def row_slots(self, i: int) -> torch.Tensor:
        """``req_to_token`` of request ``i`` up to its ``seq_lens`` (what torch_native's decode reads)."""
        return self._runner.req_to_token_pool.req_to_token[self.rows[i], :self.seq_lens[i]]

    def backend_slots(self) -> Optional[list[torch.Tensor]]:
        """The slots the decode backend's kernels read per request: triton's ``kv_indptr`` / ``kv_indices``
        (built by its KV-index kernel), torch_native's rows; None for a backend not read here."""
        if self.backend == "triton":
            metadata = self._runner.attn_backend.forward_metadata
            bounds = metadata.kv_indptr.tolist()
            return [metadata.kv_indices[bounds[i]:bounds[i + 1]] for i in range(len(self.rows))]
        if self.backend == "torch_native":
            return [self.row_slots(i) for i in range(len(self.rows))]
        return None

    def fa3_slots(self) -> tuple[list[int], list[torch.Tensor]]:
        """fa3's decode metadata for this batch, built by SGLang's ``FlashAttentionBackend.init_forward_metadata``
        (plain torch; its kernels and its scheduler-metadata precompute need CUDA) on a backend object
        holding only the fields its eager normal-decode path reads, for Llama / Qwen without sliding
        windows: ``cache_seqlens`` and each request's ``page_table`` row cut at its length."""
        from sglang.srt.layers.attention.flashattention_backend import FlashAttentionBackend

        runner = self._runner
        fa3 = object.__new__(FlashAttentionBackend)
        fa3.__dict__.update(
            max_context_len=runner.model_config.context_len, device=runner.device, page_size=runner.page_size,
            req_to_token_pool=runner.req_to_token_pool, req_to_token=runner.req_to_token_pool.req_to_token,
            token_to_kv_pool=runner.token_to_kv_pool, kv_index_translator=runner.kv_index_translator,
            topk=0, speculative_step_id=0, speculative_num_steps=0, is_prefill_aware_swa=False, has_swa=False,
            use_sliding_window_kv_pool=False, local_attn_builder=None, has_local_attention=False,
            _get_scheduler_metadata=None, use_mla=False, is_encoder_decoder=False, forward_metadata=None)
        FlashAttentionBackend.init_forward_metadata(fa3, self._batch)
        metadata = fa3.forward_metadata
        lengths = metadata.cache_seqlens_int32.tolist()
        return lengths, [metadata.page_table[i, :n] for i, n in enumerate(lengths)]

    def free_slots(self) -> torch.Tensor:
        """Slots the allocator holds free (its free and release lists, and a free group not yet merged)."""
        allocator = self._runner.token_to_kv_pool_allocator
        parts = [allocator.free_pages, allocator.release_pages, *(getattr(allocator, "free_group", None) or [])]
        return torch.cat([part.flatten().to(torch.int64) for part in parts])


def hook_decode_metadata(check: Callable[[DecodeMetadata], None]) -> None:
    """``check(metadata)`` in each decode step once the model runner's attention backend built the
    step's metadata, before any layer runs (SGLang's eager runner: ``attn_backend.init_forward_metadata``;
    not under a CUDA graph, whose metadata is written into captured buffers)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    original_init_new = ForwardBatch.init_new.__func__
    # the last decode batch's rows and token counts: the runner's forward batch is a copy of the one made
    # here (steps run one at a time: no overlap scheduler)
    last_counts: dict[str, list[int]] = {}

    def init_new(cls, batch, model_runner, **kwargs):
        forward_batch = original_init_new(cls, batch, model_runner, **kwargs)
        if forward_batch.forward_mode.is_decode() and batch.reqs:
            last_counts["rows"] = forward_batch.req_pool_indices.tolist()
            last_counts["counts"] = [len(req.origin_input_ids) + len(req.output_ids) - Request(req).evicted_positions
                                     for req in batch.reqs]
        return forward_batch

    ForwardBatch.init_new = classmethod(init_new)
    original_init = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        runner = self.tp_worker.model_runner
        build = runner.attn_backend.init_forward_metadata

        def init_forward_metadata(forward_batch):
            build(forward_batch)
            if forward_batch.forward_mode.is_decode():
                rows = forward_batch.req_pool_indices.tolist()
                if last_counts.get("rows") != rows:
                    raise RuntimeError(f"sparse-rl-mega's metadata check: a decode batch of rows {rows} was not "
                                       f"made by ForwardBatch.init_new (last: {last_counts.get('rows')})")
                check(DecodeMetadata(runner, forward_batch, last_counts["counts"]))

        runner.attn_backend.init_forward_metadata = init_forward_metadata

    Scheduler.__init__ = __init__


def hook_retraction(on_retract: Callable[[Request], None]) -> None:
    """``on_retract(request)`` when the scheduler retracts a request (its KV is then recomputed from
    the prompt and the output so far)."""
    from sglang.srt.managers.schedule_batch import Req

    original_reset = Req.reset_for_retract

    def reset_for_retract(self):
        on_retract(Request(self))
        return original_reset(self)

    Req.reset_for_retract = reset_for_retract


DROP_CACHED_PREFIXES = "sparse_rl_drop_cached_prefixes"  # the scheduler method of hook_cached_prefix_drop


def hook_cached_prefix_drop() -> None:
    """A scheduler method, called by RPC (:func:`drop_cached_prefixes`), that evicts from the radix tree
    every cached prefix no request holds: what SGLang's flush would remove, when the flush is refused
    because requests run (they keep theirs)."""
    from sglang.srt.managers.scheduler import Scheduler

    def drop(self) -> None:
        pool = KVPool(self.token_to_kv_pool_allocator, self.tree_cache)
        pool.evict_from_tree(pool.size)

    setattr(Scheduler, DROP_CACHED_PREFIXES, drop)


def hook_internal_state(key: str, report: Callable[[KVPool], dict]) -> None:
    """``get_server_info()["internal_states"][rank][key]``: ``report(the scheduler's pool)``; and
    ``[rank]["resolved"]``: what :func:`hook_scheduler_built` read (None without that hook)."""
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController

    original_state = SchedulerInternalStateController.get_internal_state

    def get_internal_state(self, recv_req):
        output = original_state(self, recv_req)
        output.internal_state[key] = report(KVPool(self.scheduler.token_to_kv_pool_allocator))
        output.internal_state["resolved"] = getattr(self.scheduler, "sparse_rl_resolved", None)
        return output

    SchedulerInternalStateController.get_internal_state = get_internal_state


def hook_admission(bounded: Callable[[list[Request]], ContextManager]) -> None:
    """Admission decisions (``schedule_policy.PrefillAdder``: each request added, and the running
    requests' reservation) run inside ``bounded(requests)``: the request being added and, where SGLang
    also accounts them, the running ones."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    def running(adder) -> list:
        batch = getattr(adder, "running_batch", None)
        return list(batch.reqs) if batch is not None and batch.reqs else []

    # the two admission paths also account the running requests; the offset is per running request
    for name, with_running in (("add_one_req", True), ("add_one_req_ignore_eos", True),
                               ("_get_running_request_total_token_offset", False)):
        original = getattr(PrefillAdder, name)

        def patched(self, req, *args, _original=original, _with_running=with_running, **kwargs):
            reqs = [req] + (running(self) if _with_running else [])
            with bounded([Request(r) for r in reqs]):
                return _original(self, req, *args, **kwargs)

        setattr(PrefillAdder, name, patched)


def hook_sampling_seeds() -> None:
    """A request's ``sampling_seed`` decides its tokens, whatever ran before.

    Stock SGLang honours ``sampling_seed`` only under ``enable_deterministic_inference``, which the CPU
    ``torch_native`` attention backend does not support; otherwise tokens come from the scheduler's
    global RNG, so the same rollout differs with the engine's history (a resumed run would not repeat
    the uninterrupted one). This fills the batch's per-request seeds whenever the sampling backend is
    ``pytorch`` (the one whose kernels take seeds); SGLang then samples each token with a Gumbel draw
    hashed from (seed, logical position), independent of batch composition. A request without a seed
    gets a random one once, so unseeded requests still sample independently."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    original = SamplingBatchInfo.from_schedule_batch.__func__

    def from_schedule_batch(cls, batch, vocab_size: int):
        info = original(cls, batch, vocab_size)
        if info.sampling_seed is None and get_exec().kernel.sampling_backend == "pytorch":
            for req in batch.reqs:
                if req.sampling_params.sampling_seed is None:
                    req.sampling_params.sampling_seed = int(torch.randint(0, 2**62, ()))
            info.sampling_seed = torch.tensor([r.sampling_params.sampling_seed for r in batch.reqs],
                                              dtype=torch.int64, device=batch.device)
        return info

    SamplingBatchInfo.from_schedule_batch = classmethod(from_schedule_batch)


def hook_loading_bar(bar: Callable) -> None:
    """``bar`` draws SGLang's weight-loading progress (``model_loader/weight_utils.py`` calls ``tqdm``)."""
    from sglang.srt.model_loader import weight_utils

    weight_utils.tqdm = bar


def hook_cpu_weight_updates(keep_mapped: Callable[[torch.Tensor], None]) -> None:
    """What a weight push needs inside a CPU scheduler (why: ``sglang_patches/push_buffers.py``):
    ``keep_mapped(flat)`` sees every shared-memory flattened bucket before it is loaded; cache flushes
    skip SGLang's CPU ``empty_cache`` (a full ``gc.collect()``); the derived-weight-cache check is asked
    once per model instead of at every bucket."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner_components import weight_updater
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    ask = weight_updater._unsupported_derived_weight_cache_error
    answers: dict = {}  # id(model) -> the check's answer (the model lives as long as the scheduler)

    def _unsupported_derived_weight_cache_error(model=None):
        if model is None:
            return ask(model)
        if id(model) not in answers:
            answers[id(model)] = ask(model)
        return answers[id(model)]

    weight_updater._unsupported_derived_weight_cache_error = _unsupported_derived_weight_cache_error

    load_flattened = WeightUpdater._update_weights_from_flattened_bucket

    def _update_weights_from_flattened_bucket(self, flattened_tensor_bucket_dict):
        flat = flattened_tensor_bucket_dict["flattened_tensor"]
        if flat.device.type == "cpu" and flat.is_shared():
            keep_mapped(flat)
        return load_flattened(self, flattened_tensor_bucket_dict)

    WeightUpdater._update_weights_from_flattened_bucket = _update_weights_from_flattened_bucket

    flush = Scheduler.flush_cache

    def flush_cache(self, empty_cache: bool = True):  # (always without the collection)
        return flush(self, empty_cache=False)

    Scheduler.flush_cache = flush_cache


# ----------------------------------------------------------------------------- the trainer's side

# what SGLang's engine processes import (a CPU forkserver preloads them)
ENGINE_MODULE = "sglang.srt.entrypoints.engine"
ENGINE_PROCESS_MODULES = ("sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager")


def engine_multiprocessing() -> Any:
    """The ``multiprocessing`` module SGLang's engine starts its processes with."""
    import importlib

    return importlib.import_module(ENGINE_MODULE).mp


def set_engine_multiprocessing(mp: Any) -> None:
    import importlib

    importlib.import_module(ENGINE_MODULE).mp = mp


# The engine's calls: coroutines that its owner runs on the engine's event loop (rollout/engine.py runs
# that loop on one thread for the engine's life, so that a pause or a weight push can run while a
# generation waits). Each builds the request as SGLang's ``Engine`` method of that name does.

async def generate(engine: Any, input_ids: list, sampling_params: Any, rids: Optional[list[str]] = None,
                   report_support: bool = False, logprob_start_len: Optional[int] = None,
                   cache_key: Optional[str] = None) -> Any:
    """``Engine.generate`` with logprobs (one output per request, in order; a single request given as
    one id list answers one output). With ``report_support`` every output's ``meta_info`` gains
    ``output_token_sampling_mask`` (the ids the top-k / top-p truncation kept at each step) and
    ``output_token_sampling_logprobs`` (the sampled token's logprob renormalised over them): SGLang's
    ``Engine.generate`` does not pass these fields through (``entrypoints/engine.py``). An output of a
    request that lived through a weight update carries ``meta_info["weight_versions"]``: the spans of
    its output tokens by the version that sampled them (``utils/weight_versions.py``). ``cache_key``:
    the requests match only prefixes cached by requests of the same key (SGLang's ``extra_key``: the
    radix tree keeps one namespace per key)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    support = {"return_sampling_mask": True, "sampling_logprobs_mode": "selected"} if report_support else {}
    request = GenerateReqInput(input_ids=input_ids, sampling_params=sampling_params, return_logprob=True,
                               logprob_start_len=logprob_start_len, rid=rids, extra_key=cache_key, **support)
    return await engine.tokenizer_manager.generate_request(request, None).__anext__()


async def flush_cache(engine: Any) -> bool:
    """Whether the scheduler emptied its prefix cache (it refuses while requests run or wait)."""
    return bool((await engine.tokenizer_manager.flush_cache()).success)


async def drop_cached_prefixes(engine: Any, timeout_s: float) -> None:
    """Evict every cached prefix no running request holds (:func:`hook_cached_prefix_drop`), beside the
    requests. SGLang's RPC socket is a blocking one (``Engine.collective_rpc`` would wait for ever on a
    dead scheduler): the request is sent and its answer awaited on a worker thread for at most
    ``timeout_s``."""
    from sglang.srt.managers.io_struct import RpcReqInput, sock_recv, sock_send

    def call() -> None:
        socket = engine.send_to_rpc
        sock_send(socket, RpcReqInput(method=DROP_CACHED_PREFIXES, parameters=None))
        if not socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the scheduler did not answer {DROP_CACHED_PREFIXES} in {timeout_s:g} s")
        reply = sock_recv(socket)
        if not reply.success:
            raise RuntimeError(f"{DROP_CACHED_PREFIXES} failed in the scheduler: {reply.message}")
    await asyncio.to_thread(call)


async def internal_states(engine: Any) -> list[dict]:
    """Each scheduler's internal state (``get_server_info()["internal_states"]``)."""
    return await engine.tokenizer_manager.get_internal_state()


async def begin_weight_update(engine: Any) -> tuple[bool, str]:
    from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

    return await engine.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(selector="all"), None)


async def end_weight_update(engine: Any) -> tuple[bool, str]:
    from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

    return await engine.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None)


async def load_flattened_bucket(engine: Any, payloads: list[bytes], version: Optional[str]) -> tuple[bool, str]:
    """Hand the engine one flattened bucket per TP rank (shared memory or CUDA IPC); ``version``: the
    weight version it serves from then on (the last bucket)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    request = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format="flattened_bucket",
                                              flush_cache=False, weight_version=version)
    return await engine.tokenizer_manager.update_weights_from_tensor(request, None)


async def receive_flattened_bucket(engine: Any, names: Iterable[str], dtype: str, shapes: Iterable[list[int]],
                                   group_name: str, version: Optional[str]) -> tuple[bool, str]:
    """Have the engine receive one flattened bucket broadcast over weight group ``group_name``."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

    names = list(names)
    request = UpdateWeightsFromDistributedReqInput(
        names=names, dtypes=[dtype] * len(names), shapes=list(shapes), group_name=group_name, flush_cache=False,
        load_format="flattened_bucket", weight_version=version)
    return await engine.tokenizer_manager.update_weights_from_distributed(request, None)


async def join_weight_group(engine: Any, master_address: str, master_port: int, rank_offset: int, world_size: int,
                            group_name: str, backend: str) -> tuple[bool, str]:
    from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

    request = InitWeightsUpdateGroupReqInput(master_address=master_address, master_port=master_port,
                                             rank_offset=rank_offset, world_size=world_size, group_name=group_name,
                                             backend=backend)
    return await engine.tokenizer_manager.init_weights_update_group(request, None)


async def release_memory(engine: Any) -> Any:
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

    return await engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)


async def resume_memory(engine: Any) -> Any:
    from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

    return await engine.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)


async def pause_generation(engine: Any, mode: str) -> None:
    """Stop the scheduler decoding (``mode`` "in_place": its requests stay with their KV; "retract":
    they go back to the waiting queue, their KV freed, and are prefilled again at
    :func:`continue_generation`). Weight updates then run without waiting for the requests
    (``tokenizer_manager.pause_generation``; generation requests sent meanwhile wait)."""
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    await engine.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=mode))


async def continue_generation(engine: Any) -> None:
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput

    await engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))


def served_weight_version(engine: Any) -> str:
    """The weight version the engine reports serving (``Engine.get_model_info``: a read, no request)."""
    return str(engine.get_model_info()["weight_version"])


def token_versions(meta_info: dict, output_tokens: int) -> list[str]:
    """The weight version that sampled each output token of a request: from its spans when it lived
    through a weight update, else the one version it reports."""
    spans = meta_info.get("weight_versions")
    if not spans:
        return [str(meta_info.get("weight_version", ""))] * output_tokens
    versions: list[str] = []
    for span in spans:
        versions += [str(span["version"])] * (int(span["end"]) - int(span["start"]))
    if len(versions) != output_tokens:
        raise RuntimeError(f"SGLang's weight-version spans {spans} cover {len(versions)} tokens of an output of "
                           f"{output_tokens}")
    return versions


_announce_load_snapshot: Optional[Callable[[str], None]] = None


def announce_load_snapshot_files(callback: Callable[[str], None]) -> None:
    """Call ``callback(path)`` with the load-snapshot file (:func:`load_snapshot_file`) of each engine this
    process starts, before any of its processes exists to create it: ``PortArgs.init_new``
    (``server_args.py``), which draws the engine's ``instance_id`` in this process, is wrapped once."""
    global _announce_load_snapshot
    from sglang.srt.managers.load_snapshot import shm_path_for
    from sglang.srt.server_args import PortArgs

    if _announce_load_snapshot is None:
        make = PortArgs.init_new

        def init_new(*args, **kwargs):
            port_args = make(*args, **kwargs)
            if port_args.instance_id:
                _announce_load_snapshot(shm_path_for(port_args.instance_id))
            return port_args
        PortArgs.init_new = staticmethod(init_new)
    _announce_load_snapshot = callback


def pid_stamped_shm_files(pids: Iterable[int]) -> list[str]:
    """The /dev/shm files that SGLang processes ``pids`` created under names stamped with their pid
    (``utils/stale_shm_cleanup.make_shm_name``: ``sgl_shm_<kind>_<pid>_<random>``; the TP group's
    message queues among them)."""
    wanted = {str(pid) for pid in pids}
    if not wanted or not os.path.isdir(SHM_DIR):
        return []
    return [os.path.join(SHM_DIR, name) for name in sorted(os.listdir(SHM_DIR))
            if name.startswith("sgl_shm_") and len(name.split("_")) >= 4 and name.split("_")[-2] in wanted]


def load_snapshot_file(engine: Any) -> Optional[str]:
    """The file in /dev/shm where the engine's scheduler publishes its load (``managers/
    load_snapshot.py``, named after the engine's ``instance_id``). SGLang never unlinks it (its writer's
    ``close`` only unmaps it, and processes end by SIGKILL), so one was left per engine start: the
    engine's owner removes it once the engine's processes are gone. None when it cannot be named."""
    from sglang.srt.managers.load_snapshot import shm_path_for

    instance_id = getattr(getattr(engine, "port_args", None), "instance_id", "")
    return shm_path_for(instance_id) if instance_id else None


def engine_loop(engine: Any) -> Any:
    return engine.loop


def stop_subprocess_watchdog(engine: Any) -> None:
    """Stop SGLang's watchdog of the engine's processes (it would report their deaths with SIGQUIT)."""
    watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()


def last_answer_time(engine: Any) -> float:
    """``time.time()`` of the last output the engine's tokenizer manager received (0 before any)."""
    return getattr(engine.tokenizer_manager, "last_receive_tstamp", 0.0)


def enable_cuda_tensor_pickling() -> None:
    """SGLang's reduction of CUDA tensors (with device UUIDs): its unpickler allows only that one."""
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()


def init_weight_group(**kwargs) -> Any:
    """A process group of the kind SGLang's engines join for weight broadcasts (``init_custom_process_group``)."""
    from sglang.srt.utils import init_custom_process_group

    return init_custom_process_group(**kwargs)
