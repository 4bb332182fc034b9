"""What a GPU attention backend reads after the KV patch compressed rows, checked in every decode step
(``EngineKVSettings.check_attention_metadata``: tests and debugging; one host copy of the step's
indices per step).

After each step's compression the patch's rows are noted (each request's ``req_to_token`` slots up to
its new length). Once the decode backend built the step's metadata, every request must have:

* lengths that agree: ``seq_lens`` (device), ``seq_lens_cpu``, ``seq_lens_sum`` and the request's own
  count (prompt + output tokens - evicted positions);
* the backend's KV indices (triton's ``kv_indptr`` / ``kv_indices``, torch_native's rows) equal to the
  noted kept slots in order, then this step's new slot;
* the same from fa3's metadata code run on the batch (``page_table`` / ``cache_seqlens``);
* no index on a slot the allocator holds free.

A disagreement is counted by kind and its first description kept (``internal_state()
["sparse_rl_metadata"]``); the step still runs, so a test reads the report rather than a dead engine.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from sparse_rl_mega.rollout import sglang_internals as sglang

KINDS = ("lengths", "backend", "fa3", "freed")


class MetadataReport:
    def __init__(self) -> None:
        self.checked_steps = 0
        # request-steps compared with the rows the patch kept: by the decode backend's indices, by fa3's table
        self.compared_rows = {"backend": 0, "fa3": 0}
        self.mismatches = dict.fromkeys(KINDS, 0)
        self.first_mismatch = ""

    def mismatch(self, kind: str, what: str) -> None:
        self.mismatches[kind] += 1
        self.first_mismatch = self.first_mismatch or f"{kind}: {what}"

    def as_dict(self) -> dict:
        return {**vars(self), "mismatches": dict(self.mismatches), "compared_rows": dict(self.compared_rows),
                "triton_interpret": os.environ.get("TRITON_INTERPRET")}


REPORT = MetadataReport()
_kept: dict[int, torch.Tensor] = {}  # row -> its slots after this step's compression (CPU)


def note_compressed_rows(batch: sglang.DecodeBatch) -> None:
    """After a step's compression: each request's row up to its (new) cached length."""
    _kept.clear()
    for request, length in zip(batch.requests, batch.seq_lens().tolist()):
        _kept[request.row] = batch.req_to_token[request.row, :length].cpu().clone()


def check(step: sglang.DecodeMetadata) -> None:
    REPORT.checked_steps += 1
    lengths = {"seq_lens_cpu": step.seq_lens_cpu, "token counts": step.token_counts}
    for name, values in lengths.items():
        if values is not None and values != step.seq_lens:
            REPORT.mismatch("lengths", f"{name} {values} != seq_lens {step.seq_lens} (rows {step.rows})")
    if step.seq_lens_sum is not None and step.seq_lens_sum != sum(step.seq_lens):
        REPORT.mismatch("lengths", f"seq_lens_sum {step.seq_lens_sum} != {sum(step.seq_lens)}")
    expected = [_expected_slots(step, i) for i in range(len(step.rows))]
    free = set(step.free_slots().tolist())
    backend = step.backend_slots()
    if backend is not None:
        _compare("backend", step, backend, expected, free)
    try:
        fa3_lengths, fa3_rows = step.fa3_slots()
    except Exception as exc:  # noqa: BLE001 (SGLang's fa3 code changed what it reads: said, not a dead scheduler)
        REPORT.mismatch("fa3", f"fa3's metadata could not be built here: {type(exc).__name__}: {exc}")
        return
    if fa3_lengths != step.seq_lens:
        REPORT.mismatch("fa3", f"cache_seqlens {fa3_lengths} != seq_lens {step.seq_lens}")
    _compare("fa3", step, fa3_rows, expected, free)


def _expected_slots(step: sglang.DecodeMetadata, i: int):
    kept = _kept.get(step.rows[i])
    if kept is None:  # (a request the patch did not see this step: its row as SGLang holds it)
        return None
    return kept.tolist() + [step.new_slots[i]]


def _compare(kind: str, step: sglang.DecodeMetadata, rows: list, expected: list, free: set) -> None:
    for i, slots in enumerate(rows):
        slots = slots.tolist()
        if expected[i] is not None:
            REPORT.compared_rows[kind] += 1
            if slots != expected[i]:
                REPORT.mismatch(kind, f"row {step.rows[i]} reads {slots}, the patch kept {expected[i]}")
        if free.intersection(slots):
            REPORT.mismatch("freed", f"{kind} row {step.rows[i]} reads free slots {sorted(free.intersection(slots))}")


def install() -> Callable[[sglang.DecodeBatch], None]:
    """Hook the decode backends' metadata and the report into the scheduler; the compression observer
    for ``kv_eviction.install``."""
    sglang.hook_decode_metadata(check)
    sglang.hook_internal_state("sparse_rl_metadata", lambda pool: REPORT.as_dict())
    return note_compressed_rows
