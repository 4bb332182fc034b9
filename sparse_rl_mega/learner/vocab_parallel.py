"""Logprobs of labels and entropy from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallelism each rank holds logits for a contiguous slice of the vocabulary
``[b, s, V / tp]``. Per position only three scalars cross ranks: the max logit (no gradient needed:
it only shifts), ``sum exp(shifted)`` and ``sum exp(shifted) * shifted``, plus the label's logit from
the rank that owns it. Sums use Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce
forward, identity backward), which is the right gradient when every TP rank computes the same loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits [b, s, V_local]`` (this TP rank's vocabulary slice), ``labels [b, s]`` -> logprob of each
    label ``[b, s]`` and the entropy of each position's distribution ``[b, s]`` (float32, or float64
    for float64 logits)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    tp = ps.get_tensor_model_parallel_world_size()
    vocab_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vocab_local

    local_max = logits.detach().amax(dim=-1)
    if tp > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()

    in_slice = (labels >= start) & (labels < start + vocab_local)
    local_index = (labels - start).clamp(0, vocab_local - 1)
    label_logit = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1) * in_slice

    sums = [exp.sum(dim=-1), label_logit]
    if with_entropy:
        sums.append((exp * shifted).sum(dim=-1))
    packed = torch.stack(sums)
    if tp > 1:
        packed = reduce_from_tensor_model_parallel_region(packed)
    sum_exp, label_logit = packed[0], packed[1]
    log_sum_exp = sum_exp.log()
    logp = label_logit - log_sum_exp
    entropy = log_sum_exp - packed[2] / sum_exp if with_entropy else None
    return logp, entropy
