"""The samples each iteration trains on, and the overlap of rollouts with training
(``rollout.max_staleness``, docs/algorithm.md "Overlapped rollouts").

``K = 0``: iteration i's prompts are sampled when it starts, by engines serving the weights after i
iterations (the learner's own).

``K >= 1``, one batch ahead: as soon as iteration i has its samples, the engines start on iteration
i+1's prompts with the weights they serve and decode them in their own processes while the learner
trains on iteration i. Weights go to idle engines only: a push first waits for the batch in flight,
so every sample comes from one weight version. When the trainer pushes (often enough that no batch is
more than K versions old when trained) is sparse_rl_mega/train/cadence.py's rule.

Partial rollouts (``rollout.partial`` stale / reprefill): a push that neither a checkpoint nor an
evaluation nor the last iteration asks for does not wait. The engines pause the requests in flight,
take the weights and resume them (their tokens from then on carry the new version), and at once start
every batch the bound allows: batch j as soon as they serve version j - K (K = 1: the batch after
next starts at the push, beside the tail of the batch ahead). A token is then never more than K
versions old when trained. The other pushes collect the batch ahead first, as without partial
rollouts, so a checkpoint saves it complete; a batch further ahead in flight at a checkpoint (K >= 2)
is sampled again by a resumed run, from its start, with the weights the checkpoint holds.
Colocated engines on GPUs hand their memory to the learner while it trains and hold no weights after
that, so they generate the next batch before the learner trains and nothing overlaps there.

A token's *staleness* = the learner's version when it trains on it minus the version that sampled it;
a sample's, that of its first (oldest) token. A batch holding a sample more than K
versions old is dropped and sampled again with the learner's weights (counted in
``rollout/stale_dropped_samples``): with that schedule it happens only when a run is resumed
with a smaller K than the one that saved the batch ahead.

The batch ahead is saved with every checkpoint (the push before a checkpoint collects it), so a
resumed run trains on exactly the samples the uninterrupted run trains on. An engine that fails
while generating is restarted with the learner's current weights and samples its shard again (that
shard's samples then have staleness 0; see rollout/fleet.py).

With an automatic KV budget (``rollout.kv_compression.auto_budget``, kv/auto_budget.py) each batch is
sampled at the budget in force when it starts (the batch ahead: the one chosen before it started), the
same on every engine and again when a failed engine samples its shard anew; the budget is then set from
the mismatch of the iteration that trained on it (:meth:`OverlappedRollouts.adapt_budget`).

Every method is a collective (all ranks call it) unless it says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.batch import RolloutBatch, pack_samples
from sparse_rl_mega.data.formatting import encode_prompt
from sparse_rl_mega.kv.auto_budget import BudgetController
from sparse_rl_mega.kv.registry import policy_class
from sparse_rl_mega.kv.replay import replay_compression
from sparse_rl_mega.reward.scorer import ScorerStats
from sparse_rl_mega.rollout.engine import EngineFailure, RolloutEngine
from sparse_rl_mega.rollout.generation import PendingGeneration
from sparse_rl_mega.rollout.placement import prompt_shard

AHEAD_FILE = "rollout_ahead.pt"  # in a checkpoint folder: the batch the next iteration trains on


@dataclass
class InFlight:
    """Engine host: its engine's shard of an iteration's prompts, being generated."""
    engine: RolloutEngine
    iteration: int
    prompts: range           # the shard: prompt numbers within the iteration
    labels: list[str]        # the shard's labels (rewards)
    pending: PendingGeneration
    kv_before: dict          # the engine's KV counters before it started (partial rollouts: at the last collection)
    budget: Optional[int]    # the KV budget its requests keep (None: the engine's own)
    idle_s: float            # how long the engine sat idle before it started (0 for its first batch)
    version: int             # the weights the engine served when it started


@dataclass
class SampledBatch:
    """An iteration's samples gathered from every engine (every rank holds the whole batch)."""
    iteration: int
    batch: RolloutBatch
    metrics: dict[str, float]   # rollout/, reward/, kv/ and the engines' time/generate_s, time/rollout_tokens_per_s, time/engine_idle_s
    example: str                # the first response, for the console
    kv_budget: Optional[int]    # the KV budget its requests kept (None: dense, or the engine's own setting)

    def state(self) -> dict:
        return {"iteration": self.iteration, "metrics": self.metrics, "example": self.example,
                "kv_budget": self.kv_budget, "batch": {f.name: getattr(self.batch, f.name) for f in fields(self.batch)}}

    @classmethod
    def from_state(cls, state: dict) -> SampledBatch:
        metrics = state["metrics"]
        budget = state.get("kv_budget", int(metrics["kv/budget"]) if "kv/budget" in metrics else None)  # (older saves)
        return cls(iteration=state["iteration"], batch=RolloutBatch(**state["batch"]), metrics=metrics,
                   example=state["example"], kv_budget=budget)


class OverlappedRollouts:
    def __init__(self, cfg, fleet, dataset, tokenizer=None, scorer=None, log=print):
        """``tokenizer`` and ``scorer``: engine hosts only (prompts are encoded and scored there)."""
        self.cfg, self.fleet, self.dataset, self.tokenizer, self.scorer, self.log = \
            cfg, fleet, dataset, tokenizer, scorer, log
        self.max_staleness = cfg.rollout.max_staleness
        self.partial = cfg.rollout.partial != "none"  # rollout.partial: pushes pause the batches in flight
        self.in_flight: dict[int, InFlight] = {}  # host: its shards of started batches, by iteration
        self.started: set[int] = set()  # the iterations whose batches were started and not yet taken
        self.ahead: Optional[SampledBatch] = None  # the first of them, once collected (or loaded from a checkpoint)
        self.engine_finished_at: Optional[float] = None  # host: when its engine finished its last batch
        # host: (engine, its KV counters) when the last shard was collected; with partial rollouts batches
        # overlap on the engine, so each collection reports the engine's work since the previous one
        self.kv_collected: Optional[tuple[RolloutEngine, dict]] = None
        self.generated: list[tuple[int, int, float, float]] = []  # (iteration, engine, start, end) since drained
        self.budget_control = BudgetController.from_config(cfg.rollout.kv_compression)  # None: a fixed budget
        self.batch_budgets: dict[int, int] = {}  # iteration -> the budget its batch was started with
        if self.partial and fleet.release_memory:
            raise ValueError(f"rollout.partial={cfg.rollout.partial!r} with colocated engines on GPUs: they hand "
                             f"their memory, KV included, to the learner at every push, so no request can be paused "
                             f"across one; set rollout.partial: none, or rollout.placement: separate")
        if self.max_staleness and fleet.release_memory:
            log(f"[setup] rollout.max_staleness={self.max_staleness} with colocated engines on GPUs: they hand their "
                f"memory to the learner while it trains, so the next batch is generated before training (samples "
                f"one version old, nothing overlaps); rollout.placement: separate overlaps, or set max_staleness: 0")

    # ------------------------------------------------------------------ the iteration's samples
    def take(self, iteration: int, timer) -> SampledBatch:
        """The batch iteration ``iteration`` trains on (the learner holds the weights after
        ``iteration`` iterations): the batch ahead when there is one, else sampled now. Its metrics
        get the staleness figures."""
        with timer.phase("learner_wait"):
            collected = self.ahead is not None and self.ahead.iteration == iteration
            if iteration in self.started and not collected:
                self.ahead = self.generate(iteration, iteration, timer)
            sampled = self.ahead if self.ahead is not None and self.ahead.iteration == iteration else None
            self.ahead = None
            self.started = {i for i in self.started if i > iteration}
            self.batch_budgets = {i: b for i, b in self.batch_budgets.items() if i > iteration}
            dropped = 0
            if sampled is not None:
                oldest = iteration - int(sampled.batch.weight_versions.min())
                if oldest > self.max_staleness:
                    dropped = sampled.batch.size
                    self.log(f"[rollout] iteration {iteration + 1}: the batch ahead has samples {oldest} weight "
                             f"version(s) old, more than rollout.max_staleness={self.max_staleness}: dropped "
                             f"({dropped} samples), sampling again with the learner's weights")
                    sampled = None
            if sampled is None:
                sampled = self.generate(iteration, iteration, timer)
        staleness = (iteration - sampled.batch.weight_versions).double()
        sampled.metrics.update({"rollout/staleness_mean": float(staleness.mean()),
                                "rollout/staleness_max": float(staleness.max()),
                                "rollout/stale_dropped_samples": float(dropped),
                                **token_ages(sampled.batch, iteration, self.max_staleness)})
        return sampled

    def start_ahead(self, iteration: int, timer) -> None:
        """Right after :meth:`take` of iteration ``iteration - 1``: with ``max_staleness`` >= 1 the
        engines start on iteration ``iteration``'s prompts (none past the last iteration) and this
        returns at once. Colocated engines on GPUs generate it now (the learner needs their memory)."""
        if not self.max_staleness or iteration >= self.cfg.trainer.iterations:
            return
        if self.fleet.release_memory:
            self.started.add(iteration)
            with timer.phase("learner_wait"):
                self.ahead = self.generate(iteration, iteration - 1, timer)
            return
        self._start_batches(iteration)

    def start_after_push(self, trained: int) -> None:
        """Partial rollouts, after a push that did not wait for the batches in flight (``trained``:
        iterations trained, the version just pushed): start every batch the bound allows (host: at once)."""
        self._start_batches(trained)

    def _start_batches(self, first: int) -> None:
        """Start the batch of iteration ``first`` and, with partial rollouts, of every later iteration
        whose tokens, sampled from the weights the engines serve, will be at most K versions old
        when trained; none past the last iteration, none started twice."""
        last = max(first, self.fleet.version + self.max_staleness) if self.partial else first
        for iteration in range(first, min(last, self.cfg.trainer.iterations - 1) + 1):
            if iteration in self.started:
                continue
            self.started.add(iteration)
            if self.fleet.placement is not None:
                try:
                    self.in_flight[iteration] = self._start_shard(self.fleet.engine, iteration)
                except EngineFailure:  # its calls fail again when collected: restarted then
                    self.in_flight.pop(iteration, None)

    def collect(self, learner_version: int, timer) -> None:
        """Wait for the first batch in flight (before the engines take weights, or when its iteration
        starts); ``learner_version``: the weights a failed engine is restarted with."""
        first = min(self.started, default=None)
        if first is None or (self.ahead is not None and self.ahead.iteration == first):
            return
        with timer.phase("learner_wait"):
            self.ahead = self.generate(first, learner_version, timer)

    def drain_timeline(self) -> list[tuple[int, int, float, float]]:
        """Rank 0: ``(iteration, engine, started, finished)`` of every batch gathered since the last call."""
        out, self.generated = self.generated, []
        return out

    # ------------------------------------------------------------------ the automatic budget
    def adapt_budget(self, metrics: dict[str, float], sampled: SampledBatch) -> Optional[str]:
        """Set the budget of the batches started from now on from the mismatch an iteration measured (its
        merged ``metrics``) on the batch it trained on (``sampled``, at the budget it was sampled at);
        rank 0's decision is every rank's. Returns
        the console's note when the budget changed (None without an automatic budget)."""
        if self.budget_control is None:
            return None
        before = self.budget_control.budget
        step = self.budget_control.update(metrics, sampled.kv_budget)
        decided = [step.budget]
        dist.broadcast_object_list(decided, src=0)  # (the same integers everywhere; one source regardless)
        self.budget_control.budget = decided[0]
        if decided[0] == before:
            return None
        why = (f"p{self.budget_control.quantile:g} of log rho {step.log_rho_quantile:.3f} < "
               f"log {self.budget_control.min_rho:g}" if step.violated else "within the target")
        return f"next KV budget {decided[0]} (was {before}: {why})"

    def budget_state(self) -> Optional[dict]:
        """What a checkpoint keeps of the automatic budget (None without one)."""
        return self.budget_control.state() if self.budget_control is not None else None

    def load_budget(self, state: Optional[dict]) -> Optional[str]:
        """Continue the automatic budget saved in a checkpoint; returns the console's line about it."""
        if self.budget_control is None or state is None:
            return None
        saved = self.budget_control.load_state(state)
        clamped = "" if saved == self.budget_control.budget else \
            f" (saved {saved}, clamped to auto_budget [{self.budget_control.low}, {self.budget_control.high}])"
        return f"KV budget {self.budget_control.budget} continues from the checkpoint{clamped}"

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: Path) -> None:
        """Rank 0: the collected batch ahead into checkpoint ``folder`` (nothing without one)."""
        if self.ahead is not None:
            torch.save(self.ahead.state(), Path(folder) / AHEAD_FILE)

    def load(self, folder: Path) -> None:
        """The batch ahead saved in checkpoint ``folder``, if any (every rank reads it)."""
        path = Path(folder) / AHEAD_FILE
        if path.is_file():
            self.ahead = SampledBatch.from_state(torch.load(path, weights_only=False))
            self.started = {self.ahead.iteration}

    # ------------------------------------------------------------------ sampling
    def generate(self, iteration: int, learner_version: int, timer) -> SampledBatch:
        """Iteration ``iteration``'s batch: each engine host finishes its shard in flight or samples it
        now; an engine that fails is restarted with the learner's weights (``learner_version``) and
        samples its shard again. Every rank gets the whole batch in prompt order."""
        cfg = self.cfg

        def my_shard(engine):
            shard = self.in_flight.pop(iteration, None)
            if shard is None or shard.engine is not engine:
                shard = self._start_shard(engine, iteration)
            return self._finish_shard(shard, timer)
        mine = self.fleet.run_on_engines(my_shard, learner_version)
        shards: list = [None] * dist.get_world_size()
        dist.all_gather_object(shards, mine)
        shards = sorted((s for s in shards if s is not None), key=lambda s: s["first_prompt"])
        # every prompt of the iteration exactly once, each with its whole group
        n = cfg.rollout.n_samples_per_prompt
        covered = [sample.prompt_index for s in shards for sample in s["samples"][::n]]
        if covered != list(range(cfg.data.prompts_per_iteration)) or \
                any(len(s["samples"]) != n * len(s["samples"][::n]) for s in shards):
            raise RuntimeError(f"rollout shards do not cover the {cfg.data.prompts_per_iteration} prompts once "
                               f"each: got prompts {covered}")
        samples = [sample for s in shards for sample in s["samples"]]
        rewards = [reward for s in shards for reward in s["rewards"]]
        batch = pack_samples(samples, rewards, pad_id=shards[0]["pad_id"], temperature=cfg.rollout.temperature)
        per_sample = [c for s in shards for c in s["compression"]]
        response_lens = [len(x.response_ids) for x in samples]
        dense_tokens = [len(x.prompt_ids) + max(len(x.response_ids) - 1, 0) for x in samples]
        evicted = sum(s["kv"]["evicted_tokens"] for s in shards)
        scored = ScorerStats()
        for s in shards:
            scored.add(s["scorer"])
        generated = [s["generated"] for s in shards]
        generate_s = max(end - start for _, start, end in generated)  # the slowest engine's
        metrics = {
            "reward/mean": float(batch.rewards.mean()),
            **scored.metrics("reward/"),
            "rollout/engines": float(len(shards)),
            "rollout/samples": float(len(samples)),
            "rollout/weight_version": float(batch.weight_versions.min()),  # the oldest
            "rollout/response_len_mean": sum(response_lens) / len(response_lens),
            "rollout/truncated_fraction": sum(x.finish_reason == "length" for x in samples) / len(samples),
            # samples whose tokens came from several weight versions (paused across a push: rollout.partial)
            "rollout/multi_version_fraction": sum(len(set(x.token_versions or ())) > 1 for x in samples) / len(samples),
            "kv/evicted_tokens": evicted,
            "kv/evicted_tokens_per_sample": evicted / len(samples),
            "kv/evicted_tokens_per_sample_max": float(max(r.evicted_tokens for r in per_sample)),
            "kv/compressions_per_sample": sum(r.compressions for r in per_sample) / len(samples),
            # the KV each sample needed at its largest, and as a fraction of its dense KV (prompt + response)
            "kv/peak_tokens_per_sample": sum(r.peak_tokens for r in per_sample) / len(samples),
            "kv/peak_tokens_per_sample_max": float(max(r.peak_tokens for r in per_sample)),
            "kv/peak_fraction_of_dense": sum(r.peak_tokens for r in per_sample) / max(sum(dense_tokens), 1),
            "kv/compactions": sum(s["kv"]["compactions"] for s in shards),
            "kv/freed_slots": sum(s["kv"]["freed_slots"] for s in shards),
            "kv/peak_slots_in_use": max(s["peak_slots_in_use"] for s in shards),  # per engine
            "kv/pool_size": float(shards[0]["pool_size"]),
            **({"kv/budget": float(shards[0]["budget"]),  # the budget the batch was sampled at
                # the most KV one request held in a decode step, as the engines measured it
                "kv/peak_request_tokens": max(s["peak_request_tokens"] for s in shards)}
               if shards[0]["budget"] is not None else {}),
            "time/generate_s": generate_s,
            # response tokens decoded per second of that slowest engine's wall time (all engines together)
            "time/rollout_tokens_per_s": sum(response_lens) / max(generate_s, 1e-9),
            "time/engine_idle_s": max(s["idle_s"] for s in shards),  # before it started this batch
        }
        if dist.get_rank() == 0:
            self.generated += [(iteration, *g) for g in generated]
        return SampledBatch(iteration, batch, metrics, samples[0].response_text, shards[0]["budget"])

    def _start_shard(self, engine: RolloutEngine, iteration: int) -> InFlight:
        """Host: ``engine`` starts on its shard of iteration ``iteration``'s prompts."""
        cfg, r = self.cfg, self.cfg.rollout
        records = self.dataset.batch(iteration, cfg.data.prompts_per_iteration, cfg.data.seed, cfg.data.shuffle)
        shard = prompt_shard(len(records), len(self.fleet.placements), self.fleet.placement.index)
        prompts_ids = [encode_prompt(self.tokenizer, records[i].prompt) for i in shard]
        kv_before = self._counters_at_last_collection(engine)
        if kv_before is None:
            kv_before = engine.kv_stats()
        budget, override = None, None
        if r.kv_compression.policy != "none":
            budget = r.kv_compression.budget
            if self.budget_control is not None:  # the same for a shard sampled again after a failure
                budget = self.batch_budgets.setdefault(iteration, self.budget_control.budget)
                override = {"budget": budget}
        # the seeds of one engine given every prompt: the same samples for any number of engines
        # with top-k / top-p each token comes with the support it was drawn from (the learner renormalises there)
        pending = engine.start_generate(prompts_ids, r.n_samples_per_prompt, r.max_new_tokens, r.temperature, r.top_p,
                                        seed=cfg.trainer.seed * 100_003 + iteration * 7919, kv_override=override,
                                        prompt_offset=shard.start, top_k=r.top_k, report_support=r.truncates)
        # (partial rollouts: another batch may be running, or have finished without being collected yet)
        running = [f.pending.finished_at for f in self.in_flight.values() if f.engine is engine]
        last = max([t for t in running if t is not None] + [self.engine_finished_at or 0.0])
        idle = 0.0 if None in running or not last else max(pending.started_at - last, 0.0)
        return InFlight(engine, iteration, shard, [records[i].label for i in shard], pending, kv_before, budget, idle,
                        engine.weight_version)

    def _counters_at_last_collection(self, engine: RolloutEngine) -> Optional[dict]:
        """Partial rollouts: ``engine``'s KV counters when its last shard was collected (None otherwise,
        or when that was another engine, one since restarted)."""
        if self.partial and self.kv_collected is not None and self.kv_collected[0] is engine:
            return self.kv_collected[1]
        return None

    def _finish_shard(self, shard: InFlight, timer) -> dict:
        """Host: wait for ``shard``'s samples and score them."""
        engine = shard.engine
        with timer.phase("rollout"):
            samples = shard.pending.result()
            kv_after = engine.kv_stats()
        # (partial rollouts: the batches overlapped, so the engine's work since the previous collection)
        kv_before = self._counters_at_last_collection(engine)
        if kv_before is None:
            kv_before = shard.kv_before
        self.kv_collected = (engine, kv_after)
        self.engine_finished_at = max(shard.pending.finished_at, self.engine_finished_at or 0.0)
        for sample in samples:  # the iteration's prompt numbering (GRPO group ids)
            sample.prompt_index += shard.prompts.start
        versions = {v for s in samples for v in s.token_versions or ()}
        expected = set(range(shard.version, engine.weight_version + 1))
        if not versions <= expected:  # a token sampled with weights the engine was not given meanwhile
            raise RuntimeError(f"engine {self.fleet.placement.index}: rollout tokens report weight version(s) "
                               f"{sorted(versions - expected)}, expected {shard.version}..{engine.weight_version}")
        with timer.phase("reward"):
            rewards = self.scorer.score([s.response_text for s in samples],
                                        [shard.labels[s.prompt_index - shard.prompts.start] for s in samples])
        return {
            "first_prompt": shard.prompts.start, "samples": samples, "rewards": rewards,
            "scorer": self.scorer.last_stats, "pad_id": self.tokenizer.pad_token_id or 0,
            "compression": self._per_sample_compression(engine, samples, shard.budget),
            "budget": shard.budget,
            "peak_request_tokens": float(kv_after.get("peak_request_tokens", 0)),
            "kv": {key: float(kv_after.get(key, 0) - kv_before.get(key, 0))
                   for key in ("evicted_tokens", "compactions", "freed_slots")},
            "peak_slots_in_use": float(kv_after.get("peak_slots_in_use", 0)),
            "pool_size": float(kv_after.get("pool_size", 0)),
            "generated": (self.fleet.placement.index, shard.pending.started_at, shard.pending.finished_at),
            "idle_s": shard.idle_s,
        }

    def _per_sample_compression(self, engine: RolloutEngine, samples, budget: Optional[int]):
        """What compression did to each sample (kv/replay.py CompressionReplay), replayed from its
        lengths at ``budget`` (None: dense)."""
        kv = self.cfg.rollout.kv_compression
        if budget is None:  # dense: nothing evicted, every sample's KV whole
            budget, interval, needed = 1 << 62, 1, 0
        else:
            interval, needed = kv.interval, (kv.window if policy_class(kv.policy).records_queries() else 0)
        newlines = set(engine.kv.newline_token_ids)
        return [replay_compression(len(s.prompt_ids), len(s.response_ids), budget, interval, needed,
                                   [t in newlines for t in s.response_ids]) for s in samples]


def token_ages(batch: RolloutBatch, iteration: int, max_staleness: int) -> dict[str, float]:
    """How old the batch's response tokens are when iteration ``iteration`` trains on them: the mean,
    and the fraction of each age 0..``max_staleness`` (``rollout/token_age{a}_fraction``)."""
    if batch.token_versions is None:
        return {}
    mask = batch.response_mask > 0
    ages = (iteration - batch.token_versions.long())[mask].double()
    count = max(ages.numel(), 1)
    return {"rollout/token_staleness_mean": float(ages.sum()) / count,
            **{f"rollout/token_age{a}_fraction": float((ages == a).sum()) / count for a in range(max_staleness + 1)}}
