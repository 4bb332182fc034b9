"""Megatron-Core learner: model building, HF weight mapping, logprobs, the corrected train step."""
