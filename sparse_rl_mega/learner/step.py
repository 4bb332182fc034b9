"""Learner passes over a :class:`RolloutBatch`: dense logprobs (forward only) and the corrected
train step, both through Megatron's pipeline schedule, so they work for any TP/PP/DP layout.

Logprobs come from ``GPTModel(..., labels=...)``, which returns the vocab-parallel cross entropy
(``-logprob``) of every label without gathering the full vocabulary under TP.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.algo.loss import policy_loss
from sparse_rl_mega.batch import RolloutBatch
from sparse_rl_mega.config import AlgorithmConfig
from sparse_rl_mega.learner.model import Learner


def _microbatches(batch: RolloutBatch, micro_batch_size: int, with_loss_inputs: bool) -> list[dict]:
    positions = torch.arange(batch.width).unsqueeze(0)
    out = []
    for start in range(0, batch.size, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        mb = {"input_ids": batch.input_ids[rows], "labels": batch.labels[rows],
              "position_ids": positions.expand(batch.input_ids[rows].shape[0], -1)}
        if with_loss_inputs:
            mb.update(logp_old=batch.logp_old[rows], advantages=batch.advantages[rows],
                      is_weights=batch.is_weights[rows], loss_mask=batch.loss_mask[rows])
        out.append(mb)
    return out


def _run_schedule(learner: Learner, microbatches: list[dict], loss_fn, width: int, micro_batch_size: int,
                  forward_only: bool) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["input_ids"], mb["position_ids"], None, labels=mb["labels"])
        return output, partial(loss_fn, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=[learner.model],
        num_microbatches=len(microbatches), seq_length=width, micro_batch_size=micro_batch_size,
        forward_only=forward_only)


def _pp_last_rank() -> int:
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_last_rank()


@torch.no_grad()
def forward_logprobs(learner: Learner, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor:
    """Dense logprobs of ``batch.labels`` ``[N, S]`` (float32), on every rank of the PP group."""
    from megatron.core import parallel_state as ps

    def logprob_loss(mb, output):
        return output.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"logp": -output.detach().float()}

    learner.model.eval()
    mbs = min(micro_batch_size, batch.size)
    results = _run_schedule(learner, _microbatches(batch, mbs, False), logprob_loss, batch.width, mbs, True)
    learner.model.train()
    if ps.is_pipeline_last_stage():
        logp = torch.cat([r["logp"] for r in results], dim=0)
    else:
        logp = torch.empty(batch.size, batch.width)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(logp, src=_pp_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return logp


def train_step(learner: Learner, batch: RolloutBatch, algo: AlgorithmConfig, micro_batch_size: int,
               dp_group: Optional[dist.ProcessGroup]) -> dict[str, float]:
    """One optimizer step on this data-parallel rank's share of a global batch.

    Each micro-batch returns ``(loss_sum, count)``; Megatron sums the counts over all micro-batches
    and data-parallel ranks and divides the gradients by that total, so the step's gradient is the
    same for any split of the global batch. Returns metrics on every rank (from the last PP stage)."""
    from megatron.core import parallel_state as ps

    def corrected_loss(mb, output):
        logp_theta = -output.float()
        loss_sum, count, stats = policy_loss(
            logp_theta, mb["logp_old"], mb["advantages"], mb["is_weights"], mb["loss_mask"],
            eps_clip_low=algo.eps_clip_low, eps_clip_high=algo.eps_clip_high, agg_mode=algo.loss_agg_mode)
        report = torch.stack([loss_sum.detach(), count.detach(), stats["clipped_tokens"], stats["kept_tokens"],
                              stats["approx_kl_old_sum"]]).to(torch.float64)
        return loss_sum, count.to(torch.int), {"report": report}

    learner.model.zero_grad_buffer()
    learner.optimizer.zero_grad()
    results = _run_schedule(learner, _microbatches(batch, micro_batch_size, True), corrected_loss, batch.width,
                            micro_batch_size, False)
    update_ok, grad_norm, _ = learner.optimizer.step()
    report = torch.zeros(5, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        for r in results:
            report += r["report"]
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(report, group=dp_group)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(report, src=_pp_last_rank(), group=ps.get_pipeline_model_parallel_group())
    loss_sum, count, clipped, kept, kl_sum = report.tolist()
    return {"train/loss": loss_sum / max(count, 1.0), "train/clip_fraction": clipped / max(kept, 1.0),
            "train/approx_kl_old": kl_sum / max(kept, 1.0), "train/kept_tokens": kept,
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/update_ok": float(bool(update_ok))}
