"""Reproducible sampling: a request's ``sampling_seed`` decides its tokens, whatever ran before.

Stock SGLang honours ``sampling_seed`` only under ``enable_deterministic_inference``, which the CPU
``torch_native`` attention backend does not support; otherwise tokens come from the scheduler's
global RNG, so the same rollout differs with the engine's history (a resumed run would not repeat
the uninterrupted one). This patch fills the batch's per-request seeds whenever the sampling backend
is ``pytorch`` (the one whose kernels take seeds); SGLang then samples each token with a Gumbel draw
hashed from (seed, logical position), independent of batch composition. A request without a seed
gets a random one once, so unseeded requests still sample independently.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("sparse_rl_mega.sglang_patches")


def install() -> None:
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    original = SamplingBatchInfo.from_schedule_batch.__func__

    def from_schedule_batch(cls, batch, vocab_size: int):
        info = original(cls, batch, vocab_size)
        if info.sampling_seed is None and get_exec().kernel.sampling_backend == "pytorch":
            for req in batch.reqs:
                if req.sampling_params.sampling_seed is None:
                    req.sampling_params.sampling_seed = int(torch.randint(0, 2**62, ()))
            info.sampling_seed = torch.tensor([r.sampling_params.sampling_seed for r in batch.reqs],
                                              dtype=torch.int64, device=batch.device)
        return info

    SamplingBatchInfo.from_schedule_batch = classmethod(from_schedule_batch)
    logger.info("sparse_rl_mega seeded sampling installed")
