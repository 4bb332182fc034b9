"""Attention mass that decode queries paid to the cached keys (H2O's accumulated scores), one step at a
time or several steps at once."""
from __future__ import annotations

from typing import Optional

import torch



def decode_attention_mass(keys: torch.Tensor, query: torch.Tensor, scaling: float,
                          lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention one decode query pays to every cached key, summed over each KV head's query group:
    ``keys [..., kv_heads, length, d]``, ``query [..., q_heads, d]`` -> ``[..., kv_heads, length]``
    (float32). With a batch dimension, ``lengths [n]`` masks each request's keys past its length.
    H2O adds this up over decode steps."""
    kv_heads, length = keys.shape[-3], keys.shape[-2]
    group = query.shape[-2] // kv_heads
    k = keys.float().repeat_interleave(group, dim=-3)  # [..., q_heads, length, d]
    logits = (k @ query.float().unsqueeze(-1)).squeeze(-1) * scaling  # [..., q_heads, length]
    if lengths is not None:
        beyond = torch.arange(length, device=keys.device) >= lengths.unsqueeze(-1)  # [n, length]
        logits = logits.masked_fill(beyond.unsqueeze(-2), float("-inf"))
    probs = logits.softmax(dim=-1)
    mass: torch.Tensor = probs.view(*probs.shape[:-2], kv_heads, group, length).sum(dim=-2)
    return mass



def window_attention_mass(keys: torch.Tensor, queries: torch.Tensor, scaling: float, lengths: torch.Tensor,
                          counts: torch.Tensor) -> torch.Tensor:
    """Attention mass that each request's last ``counts[r]`` decode queries paid to every cached key,
    summed over those queries and over each KV head's query group: what :func:`decode_attention_mass`
    adds up step by step, computed for several steps at once (the keys of a request only grow between
    compressions, so every step's keys are still in the cache).

    ``keys [n, kv_heads, L, d]`` (``L`` >= every length), ``queries [n, q_heads, w, d]`` oldest first,
    of which the last ``counts[r]`` (<= w) are real; query ``i`` belongs to cache position
    ``lengths[r] - w + i`` and saw the keys up to it. Returns ``[n, kv_heads, L]`` (float32)."""
    n, kv_heads, width, head_dim = keys.shape
    q_heads, w = queries.shape[1], queries.shape[2]
    group = q_heads // kv_heads
    q = queries.float().reshape(n, kv_heads, group * w, head_dim)  # query head h serves KV head h // group
    logits = (q @ keys.float().transpose(-1, -2) * scaling).view(n, kv_heads, group, w, width)
    on = keys.device
    query_pos = lengths.unsqueeze(1) - w + torch.arange(w, device=on)  # [n, w]
    visible = torch.arange(width, device=on) <= query_pos.unsqueeze(-1)  # [n, w, L]; also hides keys past a length
    real = torch.arange(w, device=on) >= (w - counts).unsqueeze(1)  # [n, w]
    visible &= real.unsqueeze(-1)
    visible[..., 0] |= ~real  # padding queries see one key (no NaN); their rows are zeroed below
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(dim=-1)
    probs = probs * real[:, None, None, :, None]
    return probs.sum(dim=(2, 3))
