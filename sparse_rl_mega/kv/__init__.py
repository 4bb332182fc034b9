"""KV-cache eviction: the policies (``base.py``: the shared selection; one policy per file), their registry,
when to compress and its replay, the engine's KV settings, the scoring and attention-mass kernels (torch),
the automatic budget and a reference decoder that applies a policy to an HF model. Importing the package
(the policies' declarations, the registry) imports no torch."""
from sparse_rl_mega.kv.base import EvictionPolicy, PolicyError
from sparse_rl_mega.kv.registry import (NO_POLICY, POLICIES, build_policy, policy_class, policy_names, register_policy,
                                        resolve_params)
from sparse_rl_mega.kv.replay import compression_schedule, replay_compression, should_compress
from sparse_rl_mega.kv.streaming import StreamingPolicy

__all__ = ["NO_POLICY", "POLICIES", "EvictionPolicy", "PolicyError", "StreamingPolicy", "build_policy",
           "compression_schedule", "policy_class", "policy_names", "register_policy", "replay_compression",
           "resolve_params", "should_compress"]
