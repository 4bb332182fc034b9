"""Pure-torch RL math: GRPO advantages, sparsity correction, PPO loss. No Megatron, no SGLang."""
