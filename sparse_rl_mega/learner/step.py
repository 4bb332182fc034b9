"""Learner passes over a :class:`RolloutBatch`: dense logprobs (forward only) and the corrected
train step, both through Megatron's pipeline schedule, so they work for any TP/PP/CP/DP layout.

With context parallelism each micro-batch's sequences are padded to a multiple of 2 x CP and every CP
rank gets its two chunks (:mod:`sparse_rl_mega.learner.context_parallel`); logprobs are gathered back
into whole sequences, and the loss's per-sequence terms use whole-sequence token counts.

The last pipeline stage returns vocab-parallel logits; logprobs and entropy come from
:mod:`sparse_rl_mega.learner.vocab_parallel` without gathering the vocabulary.
"""
from __future__ import annotations

import math

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.algo.loss import policy_loss
from sparse_rl_mega.batch import RolloutBatch
from sparse_rl_mega.config import AlgorithmConfig
from sparse_rl_mega.learner.context_parallel import gather_sequence, padded_width, split_sequence, width_multiple
from sparse_rl_mega.learner.model import Learner
from sparse_rl_mega.learner.vocab_parallel import logprobs_and_entropy
from sparse_rl_mega.learner.weights import as_chunks

_LOSS_INPUTS = ("logp_old", "advantages", "is_weights", "loss_mask", "logp_ref")
REPORT_KEYS = ("loss_sum", "count", "clipped_tokens", "kept_tokens", "approx_kl_old_sum", "entropy_sum", "kl_ref_sum")


def _device() -> torch.device:
    """Where the model computes: this rank's GPU, else the CPU. Batches live on the CPU (the
    correction and metrics run there) and travel to the device per micro-batch."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sequence_multiple(config) -> int:
    """Width multiple for Megatron's ``config``: CP chunks, sequence-parallel split, and FP8's token
    alignment (16, 32 for MXFP8, as Megatron pads FP8 inputs)."""
    fp8_align = (32 if config.fp8_recipe == "mxfp8" else 16) if config.fp8 else 1
    return width_multiple(config.context_parallel_size, config.tensor_model_parallel_size, config.sequence_parallel,
                          fp8_align)


def _context_parallel() -> tuple[int, int, Optional[dist.ProcessGroup]]:
    """(size, rank, group) of this rank's context-parallel group."""
    from megatron.core import parallel_state as ps

    size = ps.get_context_parallel_world_size()
    return size, ps.get_context_parallel_rank(), ps.get_context_parallel_group() if size > 1 else None


def _microbatches(batch: RolloutBatch, micro_batch_size: int, with_loss_inputs: bool, width: int,
                  cp_size: int = 1, cp_rank: int = 0, device: torch.device = torch.device("cpu")) -> list[dict]:
    """Micro-batches of ``batch`` as this rank feeds them to its model, on ``device``: ``[b, S]``
    tensors (and the ``[b, S, K]`` sampling supports, if any) right-padded to ``width`` (padding is
    masked out of the loss) and cut to this CP rank's chunks when CP > 1, ``[b]`` advantages and
    response-token counts (``response_tokens``), and with CP the whole sequences' kept-token counts
    (``seq_tokens``)."""
    def local(tensor: torch.Tensor, fill: int = 0) -> torch.Tensor:  # [b, S, ...] -> [b, width / cp, ...]
        if width > tensor.shape[1]:
            pad = tensor.new_full((tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:]), fill)
            tensor = torch.cat([tensor, pad], dim=1)
        return (split_sequence(tensor, cp_size, cp_rank) if cp_size > 1 else tensor).to(device)

    positions = torch.arange(width).unsqueeze(0)
    out = []
    for start in range(0, batch.size, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        n = batch.input_ids[rows].shape[0]
        mb = {"input_ids": local(batch.input_ids[rows]), "labels": local(batch.labels[rows]),
              "position_ids": local(positions.expand(n, -1))}
        if batch.support_counts is not None:  # [b, width / cp, K]: the sampler's top-k / top-p supports
            mb["support_ids"] = local(batch.padded_supports(rows), fill=-1)
        if with_loss_inputs:
            for name in _LOSS_INPUTS:
                value = getattr(batch, name)
                if value is not None:
                    mb[name] = value[rows].to(device) if value.dim() == 1 else local(value[rows])
            # whole sequences' token counts (a CP rank holds only part of each sequence)
            mb["response_tokens"] = batch.response_mask[rows].sum(dim=1).to(device)
            if cp_size > 1:
                mb["seq_tokens"] = batch.loss_mask[rows].sum(dim=1).to(device)
        out.append(mb)
    return out


def _run_schedule(chunks: list, microbatches: list[dict], loss_fn, width: int, micro_batch_size: int,
                  forward_only: bool) -> list:
    """Megatron's schedule over this rank's model chunks (several: the interleaved schedule, which
    gives every chunk its own pass over the same micro-batches)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        logits = chunk(mb["input_ids"], mb["position_ids"], None)  # last stage: [b, s, V / tp]
        return logits, partial(loss_fn, mb)

    iterators = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=list(chunks), num_microbatches=len(microbatches), seq_length=width,
        micro_batch_size=micro_batch_size, forward_only=forward_only)


def _pipeline_fill(chunks: list) -> int:
    """Micro-batches the interleaved schedule runs in groups of: PP (1 without virtual stages)."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1


def _broadcast_from_last_stage(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return tensor


@torch.no_grad()
def forward_logprobs(chunks, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor:
    """Dense logprobs of ``batch.labels`` ``[N, S]`` (float32) from ``chunks`` (a learner's DDP chunks
    or a frozen reference model's chunks; one module is taken as one chunk), returned on every rank of
    the pipeline group: those of the distribution the batch was sampled from (``batch.temperature``,
    renormalised over the batch's supports when the sampler truncated). The interleaved schedule needs
    a multiple of PP micro-batches: copies of the last row fill the last group and are dropped."""
    from megatron.core import parallel_state as ps

    chunks = as_chunks(chunks)

    def logprob_loss(mb, logits):
        logp, _ = logprobs_and_entropy(logits, mb["labels"], with_entropy=False, temperature=batch.temperature,
                                       support_ids=mb.get("support_ids"))
        return logits.sum() * 0.0, logits.new_ones((), dtype=torch.int), {"logp": logp}

    was_training = chunks[0].training
    for chunk in chunks:
        chunk.eval()
    mbs = min(micro_batch_size, batch.size)
    cp_size, cp_rank, cp_group = _context_parallel()
    width, device = padded_width(batch.width, _sequence_multiple(chunks[0].config)), _device()
    microbatches = _microbatches(batch, mbs, False, width, cp_size, cp_rank, device)
    fill = _pipeline_fill(chunks)
    while len(microbatches) % fill:
        microbatches.append({k: v[-1:].expand(mbs, *v.shape[1:]) for k, v in microbatches[-1].items()})
    results = _run_schedule(chunks, microbatches, logprob_loss, width, mbs, True)
    for chunk in chunks:
        chunk.train(was_training)
    if ps.is_pipeline_last_stage():
        logp = torch.cat([r["logp"] for r in results], dim=0)[:batch.size]
        logp = gather_sequence(logp, cp_group)[:, :batch.width].contiguous()
    else:
        dtype = torch.promote_types(chunks[0].config.params_dtype, torch.float32)
        logp = torch.empty(batch.size, batch.width, dtype=dtype, device=device)
    return _broadcast_from_last_stage(logp).cpu()


def corrected_loss(algo: AlgorithmConfig, temperature: float, count_sequences: bool, mb: dict,
                   logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss function for one micro-batch ``mb`` (:func:`_microbatches`, with the loss inputs)
    of the train step: ``(loss_sum, count, {"report": [len(REPORT_KEYS)] float64})``, all on the logits'
    device. ``logits`` ``[b, s, V / tp]``, of the distribution the batch was sampled from at
    ``temperature`` (and truncated to ``mb["support_ids"]``); with CP, one rank counts whole sequences
    (``count_sequences``) and the per-sequence means use whole-sequence counts."""
    logp_theta, entropy = logprobs_and_entropy(logits, mb["labels"], temperature=temperature,
                                               support_ids=mb.get("support_ids"))  # entropy: also a metric
    loss_sum, count, stats = policy_loss(logp_theta, mb["logp_old"], mb["advantages"], mb["is_weights"],
                                         mb["loss_mask"], algo, logp_ref=mb.get("logp_ref"), entropy=entropy,
                                         response_tokens=mb["response_tokens"], seq_tokens=mb.get("seq_tokens"),
                                         count_sequences=count_sequences)
    report = torch.stack([loss_sum.detach(), count.detach()] + [stats[k] for k in REPORT_KEYS[2:]])
    return loss_sum, count.to(torch.int), {"report": report.to(torch.float64)}


def forward_backward(learner: Learner, batch: RolloutBatch, algo: AlgorithmConfig, micro_batch_size: int
                     ) -> torch.Tensor:
    """Gradients of the corrected loss of one global batch (this DP rank's rows) accumulated into the
    DDP grad buffers, already reduced over DP (and CP) and divided by the step's global count. Returns
    the summed report (see ``REPORT_KEYS``) of this rank's micro-batches (zeros off the last stage; with
    CP, this rank's part of the sequences: sum it over the DP x CP group)."""
    cp_size, cp_rank, _ = _context_parallel()

    for chunk in learner.chunks:
        chunk.zero_grad_buffer()
    learner.optimizer.zero_grad()
    width, device = padded_width(batch.width, _sequence_multiple(learner.config)), _device()
    results = _run_schedule(learner.chunks, _microbatches(batch, micro_batch_size, True, width, cp_size, cp_rank,
                                                          device),
                            partial(corrected_loss, algo, batch.temperature, cp_rank == 0), width, micro_batch_size,
                            False)
    report = torch.zeros(len(REPORT_KEYS), dtype=torch.float64, device=device)
    for r in results:
        report += r["report"]
    return report


def sum_report(report: torch.Tensor) -> torch.Tensor:
    """A :func:`forward_backward` report summed over the data-parallel and context-parallel ranks (in
    place, on the last pipeline stage, where the report lives): the global step's sums."""
    from megatron.core import parallel_state as ps

    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)  # CP ranks hold parts of rows
    if ps.is_pipeline_last_stage() and dist.get_world_size(dp_cp_group) > 1:
        dist.all_reduce(report, group=dp_cp_group)
    return report


def train_step(learner: Learner, batch: RolloutBatch, algo: AlgorithmConfig, micro_batch_size: int
               ) -> dict[str, float]:
    """One optimizer step on this DP rank's share of a global batch; metrics are global (every rank).

    A step whose loss or gradient norm is NaN/Inf is skipped: weights and optimizer state stay as they
    were (``train/skipped_steps`` 1, ``train/update_ok`` 0); the next step zeroes the gradients."""
    report = forward_backward(learner, batch, algo, micro_batch_size)
    values = dict(zip(REPORT_KEYS, _broadcast_from_last_stage(sum_report(report)).tolist()))
    # Megatron's optimizer checks for inf/NaN only under a loss scaler (fp16); its norm is global (every
    # model-parallel rank computes the same value), so every rank takes the same decision
    learner.optimizer.prepare_grads()
    grad_norm = float(learner.optimizer.get_grad_norm())
    finite = math.isfinite(grad_norm) and all(math.isfinite(v) for v in values.values())
    update_ok = False
    if finite:
        update_ok, grad_norm, _ = learner.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    kept = max(values["kept_tokens"], 1.0)
    # the loss as optimised (summed, divided by the step's denominator); the others: means over kept tokens
    metrics = {"train/loss": values["loss_sum"] / max(values["count"], 1.0),
               "train/loss_denominator": values["count"],
               "train/clip_fraction": values["clipped_tokens"] / kept,
               "train/approx_kl_old": values["approx_kl_old_sum"] / kept,
               "train/entropy": values["entropy_sum"] / kept,
               "train/kept_tokens": values["kept_tokens"],
               "train/grad_norm": grad_norm,
               "train/update_ok": float(bool(update_ok)),
               "train/skipped_steps": 0.0 if finite else 1.0}
    if algo.kl_coef > 0:
        metrics["train/kl_ref"] = values["kl_ref_sum"] / kept
    return metrics
