"""The scoring the published policies share (torch, float32): the window queries' attention logits pooled
over each KV head's query group, same-length pooling along the sequence, SnapKV's window importance
and R-KV's key redundancy."""
from __future__ import annotations

import torch
import torch.nn.functional as F



def window_logits(keys: torch.Tensor, window_queries: torch.Tensor, gqa_pool: str = "max") -> torch.Tensor:
    """Attention logits of the window queries, pooled over each KV head's query group *before* any
    softmax (max or mean, as the published ``compute_attention_scores``): ``[kv_heads, window, length]``
    (float32), scaled by ``1 / sqrt(head_dim)``. ``kv_heads`` may hold several layers' heads, layer-major,
    with the queries in the same order."""
    kv_heads, length, head_dim = keys.shape
    q_heads, window, _ = window_queries.shape
    group = q_heads // kv_heads
    q = window_queries.float().reshape(kv_heads, group * window, head_dim)
    # one batched matmul per KV head (a broadcast matmul over the group axis costs ~3x on CPU)
    logits = torch.bmm(q, keys.float().transpose(-1, -2)) * head_dim ** -0.5  # [kv_heads, group * w, length]
    logits = logits.view(kv_heads, group, window, length)
    pooled: torch.Tensor = logits.amax(dim=1) if gqa_pool == "max" else logits.mean(dim=1)
    return pooled



def pool1d(scores: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Same-length pooling along the last axis of ``[heads, length]`` with ``kernel // 2`` padding on each
    side, as ``F.max_pool1d`` / ``F.avg_pool1d`` in the published code (the average counts the padding
    zeros at both ends)."""
    if kernel <= 1:
        return scores
    x = scores.unsqueeze(1)
    if mode == "max":
        return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2).squeeze(1)
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2).squeeze(1)



def window_importance(keys: torch.Tensor, window_queries: torch.Tensor, gqa_pool: str, kernel: int,
                      pool: str) -> torch.Tensor:
    """Importance of the keys before the window, ``[kv_heads, length - window]`` (float32): the pooled
    logits of the window queries, softmax over those older keys only (the window's own keys are left
    out), mean over the window's queries, then pooled along the sequence."""
    length, window = keys.shape[1], window_queries.shape[1]
    probs = window_logits(keys, window_queries, gqa_pool)[..., :length - window].softmax(dim=-1).mean(dim=1)
    return pool1d(probs, kernel, pool)



def key_redundancy(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy of every key, ``[kv_heads, length]`` (float32, a softmax over keys).

    Cosine similarity ``S`` of the keys (``k / (|k| + 1e-8)``) with the diagonal zeroed; for each key ``i``
    only the entry ``S[i, j]`` of its last near-duplicate (the largest ``j`` with ``S[i, j] > threshold``;
    ``j = 0`` when it has none) is zeroed; the redundancy of key ``j`` is the mean of column ``j`` over all
    rows, followed by a softmax over the keys."""
    k = keys.float()
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(-1, -2)  # [kv_heads, length, length]
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    above = sim > threshold  # one byte per pair (the published code builds an int64 index matrix here)
    length = sim.shape[-1]
    # max over a row gives the first maximal index: the first True from the end, and whether there is one
    has_duplicate, from_end = above.flip(-1).max(dim=-1)  # [kv_heads, L]
    last_duplicate = torch.where(has_duplicate, length - 1 - from_end, torch.zeros_like(from_end))
    del above
    sim.scatter_(-1, last_duplicate.unsqueeze(-1), 0.0)
    redundancy: torch.Tensor = sim.mean(dim=-2).softmax(dim=-1)
    return redundancy
