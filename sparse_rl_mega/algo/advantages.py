"""GRPO group advantages."""
import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantage ``(R_i - mean_group R) / (std_group R + eps)``.

    Args:
        rewards: ``[num_sequences]``, groups stored contiguously (``group_size`` samples each).
    Returns:
        ``[num_sequences]`` advantages (float32). ``std`` is the unbiased sample std, as in GRPO.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.view(-1)
