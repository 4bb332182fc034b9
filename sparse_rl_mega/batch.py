"""The batch types every phase shares: an engine's samples (:class:`GeneratedSample`) and the rollout
batch they are packed into (:class:`RolloutBatch`), which flows through reward, learner, correction
and loss. Below both the rollout (``rollout/``) and the learner (``learner/``): it imports neither.

All per-token tensors are aligned to *label* positions of the packed sequence
``input_ids = (prompt + response)[:-1]``, ``labels = (prompt + response)[1:]``, padded to a common
width ``S``; ``response_mask[i, t]`` is 1 where ``labels[i, t]`` is a sampled response token.

A batch also says how its tokens were drawn, which every learner pass must reproduce: the sampling
``temperature`` (the engine's logprobs are those of ``softmax(logits / temperature)``) and, when the
engine truncated the distribution (top-k / top-p), the support each token was drawn from: per row its
positions' ids one after another (``support_ids``) and how many each position has
(``support_counts``), compact whatever the widest support; :meth:`RolloutBatch.padded_supports` pads
a micro-batch's rows when the learner needs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional
from collections.abc import Sequence

import torch


@dataclass
class GeneratedSample:
    """One sampled response. ``logp_sparse[t]`` is the sampler's logprob of ``response_ids[t]``."""
    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logp_sparse: list[float]
    response_text: str
    finish_reason: str
    cached_tokens: int = 0  # prompt tokens served from the radix (prefix) cache
    weight_version: str = ""  # the engine's weight version when the sample finished
    # the weight version that sampled each response token (a partial rollout's sample spans several)
    token_versions: Optional[list[int]] = None
    # with top-k / top-p: the token ids the truncation kept at each response position (SGLang's
    # sampling mask); ``logp_sparse`` is then the logprob renormalised over them. None: whole vocabulary
    support: Optional[list[list[int]]] = None


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor        # [N, S] int64
    labels: torch.Tensor           # [N, S] int64
    response_mask: torch.Tensor    # [N, S] float32
    logp_sparse: torch.Tensor      # [N, S] float32, sampler logprobs of labels (0 off-response)
    rewards: torch.Tensor          # [N] float32
    group_ids: torch.Tensor        # [N] int64, GRPO group (prompt) of each sequence
    weight_versions: Optional[torch.Tensor] = None  # [N] int64, weights that sampled the row's first (oldest) token
    # [N, S] int32, weights that sampled each label (a partial rollout's row spans several; 0 off-response)
    token_versions: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None   # [N] float32
    logp_old: Optional[torch.Tensor] = None     # [N, S] float32, PPO anchor (dense learner, or sampler in bypass)
    logp_ref: Optional[torch.Tensor] = None     # [N, S] float32, frozen reference model (KL penalty)
    is_weights: Optional[torch.Tensor] = None   # [N, S] float32
    loss_mask: Optional[torch.Tensor] = None    # [N, S] float32
    response_texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    temperature: float = 1.0                    # the sampling temperature of logp_sparse
    support_counts: Optional[torch.Tensor] = None  # [N, S] int32: ids in each label's support (0: whole vocabulary)
    support_ids: list[torch.Tensor] = field(default_factory=list)  # per row [support_counts[i].sum()] int32

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    def padded_supports(self, rows: slice) -> Optional[torch.Tensor]:
        """The supports of rows ``rows`` as ``[b, S, K]`` int32, ``K`` the widest among them, -1 padding
        (a position without a support: all -1); None when the batch was not truncated."""
        if self.support_counts is None:
            return None
        counts = self.support_counts[rows].long()  # [b, S]
        out = torch.full((*counts.shape, max(int(counts.max()), 1)), -1, dtype=torch.int32)
        for row, (row_counts, ids) in enumerate(zip(counts, self.support_ids[rows])):
            position = torch.repeat_interleave(torch.arange(counts.shape[1]), row_counts)
            first = torch.repeat_interleave(row_counts.cumsum(0) - row_counts, row_counts)  # of its position's ids
            out[row, position, torch.arange(ids.numel()) - first] = ids
        return out

    def select(self, indices: torch.Tensor | Sequence[int]) -> RolloutBatch:
        """Rows ``indices`` of every tensor (lists follow)."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[idx]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in idx.tolist()] if value else []
            else:
                out[f.name] = value
        return RolloutBatch(**out)


def pack_samples(samples: Sequence[GeneratedSample], rewards: Sequence[float], pad_id: int = 0,
                 temperature: float = 1.0) -> RolloutBatch:
    """Pack engine samples (groups contiguous), drawn at ``temperature``, into a :class:`RolloutBatch`,
    with their supports if they were truncated."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples) - 1
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros(n, width)
    logp_sparse = torch.zeros(n, width)
    token_versions = torch.zeros(n, width, dtype=torch.int32)
    oldest_versions = torch.zeros(n, dtype=torch.long)
    for i, s in enumerate(samples):
        full = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        length = full.numel() - 1
        input_ids[i, :length] = full[:-1]
        labels[i, :length] = full[1:]
        start = len(s.prompt_ids) - 1  # label position of the first response token
        response_mask[i, start:start + len(s.response_ids)] = 1.0
        logp_sparse[i, start:start + len(s.response_ids)] = torch.tensor(s.logp_sparse, dtype=torch.float32)
        versions = _versions_of(s)
        token_versions[i, start:start + len(s.response_ids)] = torch.tensor(versions, dtype=torch.int32)
        oldest_versions[i] = min(versions, default=int(s.weight_version or 0))
    support_counts, support_ids = None, []
    if any(s.support is not None for s in samples):
        support_counts = torch.zeros(n, width, dtype=torch.int32)
        for i, s in enumerate(samples):
            if s.support is None or len(s.support) != len(s.response_ids):
                raise ValueError(f"sample {i} has {len(s.support or [])} sampling supports for its "
                                 f"{len(s.response_ids)} response tokens")
            start = len(s.prompt_ids) - 1
            support_counts[i, start:start + len(s.support)] = torch.tensor([len(ids) for ids in s.support])
            support_ids.append(torch.tensor([t for ids in s.support for t in ids], dtype=torch.int32))
    return RolloutBatch(input_ids=input_ids, labels=labels, response_mask=response_mask, logp_sparse=logp_sparse,
                        rewards=torch.tensor(list(rewards), dtype=torch.float32),
                        group_ids=torch.tensor([s.prompt_index for s in samples], dtype=torch.long),
                        weight_versions=oldest_versions,
                        token_versions=token_versions,
                        response_texts=[s.response_text for s in samples],
                        finish_reasons=[s.finish_reason for s in samples], temperature=temperature,
                        support_counts=support_counts, support_ids=support_ids)


def _versions_of(sample: GeneratedSample) -> list[int]:
    """The version that sampled each response token (one version for all without per-token versions)."""
    if sample.token_versions is None:
        return [int(sample.weight_version or 0)] * len(sample.response_ids)
    if len(sample.token_versions) != len(sample.response_ids):
        raise ValueError(f"{len(sample.token_versions)} token versions for {len(sample.response_ids)} response tokens")
    return list(sample.token_versions)


def data_parallel_rows(batch_size: int, global_batch_size: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    """``[batch_size / dp_size]`` int64: the rows of a rollout batch that data-parallel rank ``dp_rank``
    trains on: for optimizer step k, slice ``dp_rank`` of the k-th global batch, so the same global rows
    form step k for any DP size. Each rank's slice holds whole GRPO groups when the slice is a multiple
    of the group size (config/validation.py refuses other layouts)."""
    share = global_batch_size // dp_size
    rows = [torch.arange(k * global_batch_size + dp_rank * share, k * global_batch_size + (dp_rank + 1) * share)
            for k in range(batch_size // global_batch_size)]
    return torch.cat(rows)
