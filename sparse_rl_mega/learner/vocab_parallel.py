"""Logprobs of labels and entropy from vocab-parallel logits, without gathering the vocabulary, for
the distribution the engine sampled from: ``softmax(logits / temperature)``, renormalised over the
tokens its top-k / top-p truncation kept when those are given.

Under tensor parallelism each rank holds logits for a contiguous slice of the vocabulary
``[b, s, V / tp]``. Per position only three scalars cross ranks: the max logit (no gradient needed:
it only shifts), ``sum exp(shifted)`` and ``sum exp(shifted) * shifted``, plus the label's logit from
the rank that owns it. Sums use Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce
forward, identity backward), which is the right gradient when every TP rank computes the same loss.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def support_mask(support_ids: torch.Tensor, vocab_start: int, vocab_local: int) -> torch.Tensor:
    """``support_ids [b, s, K]`` (global token ids, ``-1`` padding) -> ``[b, s, vocab_local]`` bool:
    which tokens of this rank's vocabulary slice ``[vocab_start, vocab_start + vocab_local)`` are in
    each position's support. A position with no support id (off the response) keeps every token."""
    local = support_ids.long() - vocab_start
    in_slice = (support_ids >= 0) & (local >= 0) & (local < vocab_local)
    column = torch.where(in_slice, local, torch.full_like(local, vocab_local))  # the extra column: dropped
    mask = torch.zeros(*support_ids.shape[:2], vocab_local + 1, dtype=torch.bool, device=support_ids.device)
    mask.scatter_(-1, column, True)
    unrestricted = ~(support_ids >= 0).any(dim=-1, keepdim=True)
    return mask[..., :vocab_local] | unrestricted


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool = True,
                         temperature: float = 1.0, support_ids: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``logits [b, s, V_local]`` (this TP rank's vocabulary slice), ``labels [b, s]`` -> logprob of each
    label ``[b, s]`` and the entropy of each position's distribution ``[b, s]`` (float32, or float64
    for float64 logits), both of ``softmax(logits / temperature)`` restricted to ``support_ids
    [b, s, K]`` (global token ids, ``-1`` padding; None: the whole vocabulary) and renormalised there.
    SGLang's sampler divides the logits by the request's temperature before its softmax and its
    truncation (``layers/sampler.py``), so this is the distribution a token was drawn from."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    tp = ps.get_tensor_model_parallel_world_size()
    vocab_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vocab_local
    kept = None if support_ids is None else support_mask(support_ids, start, vocab_local)

    local_max = logits.detach()
    if kept is not None:  # (a rank may hold none of a position's support: -inf, the others' max wins)
        local_max = local_max.masked_fill(~kept, float("-inf"))
    local_max = local_max.amax(dim=-1)
    if tp > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - local_max.unsqueeze(-1)
    # tokens outside the support: exp(-inf) = 0, with a zero gradient (a product with a mask would give
    # 0 * inf = NaN for a dropped token whose logit exceeds the support's maximum)
    exp = (shifted if kept is None else shifted.masked_fill(~kept, float("-inf"))).exp()

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
