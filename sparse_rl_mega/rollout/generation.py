"""A generation an engine runs (:meth:`RolloutEngine.start_generate`): waited for as every engine call
is, then read into :class:`~sparse_rl_mega.batch.GeneratedSample` s from SGLang's outputs (tokens,
the behaviour logprobs, the sampling supports, the weight version of each token)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Optional

from sparse_rl_mega.batch import GeneratedSample
from sparse_rl_mega.rollout import sglang_internals


class PendingGeneration:
    """Samples an engine is generating (:meth:`RolloutEngine.start_generate`). ``started_at`` and
    ``finished_at`` (``time.time()``; None while it runs) time the engine's work."""

    def __init__(self, engine, future: Future, input_ids: list[list[int]], n_samples: int,
                 started_at: float, report_support: bool = False):
        self.engine, self.future, self.input_ids, self.n_samples = engine, future, input_ids, n_samples
        self.started_at, self.report_support = started_at, report_support
        self.finished_at: Optional[float] = None
        engine.in_flight.append(self)  # (before the callback: a future done already calls it at once)
        future.add_done_callback(self._finished)

    def _finished(self, future: Future) -> None:  # (on the engine's loop thread)
        self.finished_at = time.time()
        if self in self.engine.in_flight:
            self.engine.in_flight.remove(self)

    def result(self) -> list[GeneratedSample]:
        """Wait for the samples; :class:`EngineFailure` as for any engine call."""
        outputs = self.engine._wait("rollout", self.future)
        if self.finished_at is None:  # (the future's waiters wake before its callbacks run)
            self.finished_at = time.time()
        samples = []
        for k, out in enumerate(outputs):
            meta = out["meta_info"]
            token_logprobs = meta["output_token_logprobs"]
            finish = meta.get("finish_reason") or {}
            logp = [float(t[0]) for t in token_logprobs]
            support = None
            if self.report_support:  # the truncated, renormalised logprob and the ids it was drawn among
                support = [[int(i) for i in ids] for ids in meta.get("output_token_sampling_mask", [])]
                logp = [float(v) for v in meta.get("output_token_sampling_logprobs", [])]
                if not len(support) == len(logp) == len(token_logprobs):
                    why = finish.get("message", finish) if isinstance(finish, dict) else finish
                    raise RuntimeError(f"{self.engine.name} returned {len(support)} sampling supports for "
                                       f"{len(token_logprobs)} tokens of sample {k}: {why}")
            samples.append(GeneratedSample(
                prompt_index=k // self.n_samples, prompt_ids=self.input_ids[k],
                response_ids=[int(t[1]) for t in token_logprobs], logp_sparse=logp, support=support,
                response_text=out["text"], finish_reason=finish.get("type", "unknown") if isinstance(finish, dict) else str(finish),
                cached_tokens=int(meta.get("cached_tokens", 0)), weight_version=str(meta.get("weight_version", "")),
                token_versions=[int(v or 0) for v in sglang_internals.token_versions(meta, len(token_logprobs))]))
        return samples
