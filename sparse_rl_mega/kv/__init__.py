"""KV-cache eviction: policies (pure torch) and a reference decoder that applies them to an HF model."""
from sparse_rl_mega.kv.policies import (POLICIES, EvictionPolicy, PolicyError, StreamingPolicy, build_policy,
                                        compression_schedule, policy_class, policy_names, register_policy,
                                        replay_compression, should_compress)

__all__ = ["POLICIES", "EvictionPolicy", "PolicyError", "StreamingPolicy", "build_policy", "compression_schedule",
           "policy_class", "policy_names", "register_policy", "replay_compression", "should_compress"]
