"""GRPO group advantages."""
from typing import Optional

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6,
                    valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-sequence advantage ``(R_i - mean_group R) / (std_group R + eps)``.

    Args:
        rewards: ``[num_sequences]``, groups stored contiguously (``group_size`` samples each).
        valid: optional ``[num_sequences]`` bool; the group statistics then use only valid members
            (e.g. those that survived rejection) and invalid members get advantage 0.
    Returns:
        ``[num_sequences]`` advantages (float32); ``std`` is the unbiased sample std, as in GRPO.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.double().view(-1, group_size)
    weight = torch.ones_like(grouped) if valid is None else valid.double().view(-1, group_size)
    count = weight.sum(dim=1, keepdim=True)
    mean = (grouped * weight).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = (grouped - mean) * weight
    if std_normalize:
        var = (centred.pow(2)).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    return centred.view(-1).float()
