"""sparse-rl-mega: Sparse-RL on Megatron-Core (learner) and SGLang (sparse-KV rollouts)."""
__version__ = "0.1.0"
