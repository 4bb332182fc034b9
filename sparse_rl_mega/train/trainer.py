"""The Sparse-RL loop, run by every torchrun rank.

One iteration, as its phases (:meth:`Trainer.run`):
  sample (the SGLang engines, KV evicted per request; rewards: exact answer or math-verify)
  -> prepare (GRPO advantages, this DP rank's rows, dense ``logp_old`` from the Megatron learner)
  -> optimise (per step: correction (veto, token rejection, IS weights), the corrected PPO loss's step)
  -> push (engine weights from the learner shards) -> checkpoint -> evaluate (held-out accuracy on the
  engine, dense and sparse) -> report (metrics to MLflow and the console).
Push, checkpoint and evaluate follow one cadence (sparse_rl_mega/train/cadence.py). With
``rollout.max_staleness`` >= 1 the engines generate the next iteration's samples while the learner
trains on this one (sparse_rl_mega/rollout/overlap.py); weights go to the engines once they are idle.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.batch import data_parallel_rows
from sparse_rl_mega.algo.advantages import grpo_advantages
from sparse_rl_mega.algo.correction import compute_correction
from sparse_rl_mega.config import RunConfig
from sparse_rl_mega.data.formatting import encode_prompt
from sparse_rl_mega.data.jsonl import load_prompt_dataset
from sparse_rl_mega.learner.checkpoint import choose_resume_checkpoint, load_checkpoint, save_checkpoint
from sparse_rl_mega.learner.cpu_shims import seed_model_parallel_rng
from sparse_rl_mega.learner.model import build_learner, build_reference_model
from sparse_rl_mega.learner.optimizer_state import allocate_optimizer_state
from sparse_rl_mega.learner.step import forward_logprobs, train_step
from sparse_rl_mega.learner.weights import load_hf_into_learner, load_hf_into_model
from sparse_rl_mega.models.tiny import build_tiny_model
from sparse_rl_mega.reward import build_scorer
from sparse_rl_mega.rollout.engine_args import engine_kv_settings
from sparse_rl_mega.rollout.fleet import EngineFleet
from sparse_rl_mega.rollout.overlap import OverlappedRollouts
from sparse_rl_mega.rollout.supervisor import EngineStart
from sparse_rl_mega.runtime import watchdog
from sparse_rl_mega.runtime.checkpoint_files import checkpoint_folder, config_changes, config_digest
from sparse_rl_mega.runtime.faults import FaultInjector
from sparse_rl_mega.runtime.jobs import JobWideError
from sparse_rl_mega.train.cadence import Cadence
from sparse_rl_mega.train.console import PhaseClock, PhaseTimer, duration, log, progress_line
from sparse_rl_mega.train.evaluation import Evaluator
from sparse_rl_mega.train.forked_ranks import forked_rank
from sparse_rl_mega.train.step_metrics import (advantage_metrics, dense_mismatch_warning, dense_sampler_k3, merge_steps,
                                               metrics_by_staleness)
from sparse_rl_mega.train.tracking import Tracker

ENGINE_CLOSE_WAIT_S = 60.0  # how long a failed set-up waits for a starting engine, to shut it down
SHUTDOWN_SLACK_S = 60.0  # the rest of shutting down (reward workers, the last barrier), for the watchdog


def ensure_model(cfg: RunConfig) -> None:
    """Build the tiny local model on rank 0 when the config asks for it and it is missing."""
    if Path(cfg.model.path, "config.json").is_file():
        return
    if cfg.model.create_tiny is None:
        raise FileNotFoundError(f"model.path {cfg.model.path}: no HF model folder (config.json) there")
    build_tiny_model(cfg.model.path, cfg.model.arch, cfg.model.create_tiny, cfg.data.train_path,
                     cfg.data.prompt_key, cfg.data.label_key, log=log)


class Trainer:
    def __init__(self, cfg: RunConfig, launched_at: Optional[float] = None):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.dp_group = None  # this rank's data-parallel group, its rank and size in it (set up with Megatron)
        self.dp_rank = 0
        self.dp_size = 1
        self.dataset = None  # the training prompts
        self.learner = None  # the Megatron model chunks and optimizer (learner/model.py)
        self.fleet = None  # the job's engines, this rank's share of them (sparse_rl_mega/rollout/fleet.py)
        self.tracker = None
        self.scorer = None  # engine hosts: the reward scorer (math: a pool of checking processes)
        self.ref_model = None
        self.warned_dense_mismatch = False  # (warn_dense_mismatch: once per run)
        self.start_iteration = 0
        self.resumed_from: Optional[dict] = None  # the checkpoint marker when resuming
        self.engine_seconds: Optional[float] = None  # how long it took to come up
        self.rollouts = None  # the samples of each iteration, overlapped or not (rollout/overlap.py)
        self.cadence = None  # after which iterations to push, checkpoint and evaluate (cadence.py)
        self.evaluator = None  # rank 0 with an eval section: held-out accuracy (evaluation.py)
        self.tokenizer = None  # engine hosts
        self.consecutive_skips = 0  # optimizer steps skipped in a row (non-finite loss or gradient)
        self.clock = PhaseClock(launched_at)
        self.faults = FaultInjector(self.rank, cfg.trainer.run_dir, self._engine0_scheduler, cfg.checkpoint.dir)

    def _engine0_scheduler(self) -> Optional[int]:
        """Pid of engine 0's scheduler on its host (for injected faults), else None."""
        if self.engine is None or self.placement.index != 0:
            return None
        return next(iter(self.engine.processes))

    @property
    def placement(self):
        """The engine this rank hosts (sparse_rl_mega/rollout/placement.py), None when it hosts none."""
        return self.fleet.placement if self.fleet is not None else None

    @property
    def engine(self):
        """This host's engine (None off the engine hosts, or while it starts)."""
        return self.fleet.engine if self.fleet is not None else None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        p = cfg.parallel
        vpp = p.virtual_pipeline_model_parallel_size
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tensor_model_parallel_size,
                                     pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                     context_parallel_size=p.context_parallel_size)
        seed_model_parallel_rng(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dataset = load_prompt_dataset(cfg.data, default_tokenizer=cfg.model.path)

        if self.rank == 0:
            ensure_model(cfg)
        dist.barrier()
        self.clock.mark("launch and imports")
        # the engine starts in the background while the learner is built and loaded, except a colocated
        # one on a GPU: it sizes its KV pool from the memory that the loaded learner leaves
        overlap = not (torch.cuda.is_available() and cfg.rollout.placement == "colocated")
        if overlap:
            self.begin_engine_start(background=True)
        self.learner = build_learner(cfg)
        load_hf_into_learner(self.learner, cfg.model.path, cfg.model.arch)
        if cfg.algorithm.kl_coef > 0:  # frozen reference policy = the initial weights
            self.ref_model = build_reference_model(cfg)
            load_hf_into_model(self.ref_model, cfg.model.path, cfg.model.arch)
        self.clock.mark("learner")
        virtual = f"x{vpp} virtual" if vpp > 1 else ""
        log(f"[setup] learner TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size}{virtual} "
            f"CP={p.context_parallel_size} DP={self.dp_size}; weights loaded from {cfg.model.path}")
        self.maybe_resume()
        self.clock.mark("checkpoint")
        if not overlap:  # sized from what the learner leaves once its optimizer state exists
            allocate_optimizer_state(self.learner.optimizer)
            self.begin_engine_start(background=False)

        if self.rank == 0:
            resume_run = (self.resumed_from or {}).get("mlflow_run_id")
            self.tracker = Tracker(cfg, resume_run_id=resume_run, log=log)
            if self.tracker.enabled:
                how = "continued" if self.tracker.continued else "started"
                log(f"[setup] MLflow run {self.tracker.run_id} {how} at {self.tracker.tracking_uri}")
        self.clock.mark("MLflow")
        self.finish_engine_start()
        self.clock.mark("waiting for the engine")
        self.cadence = Cadence.from_config(cfg, engines_release_memory=self.fleet.release_memory)
        self.rollouts = OverlappedRollouts(cfg, self.fleet, self.dataset, self.tokenizer, self.scorer, log)
        dist.barrier()
        if self.resumed_from is not None:  # the engine loaded model.path: give it the checkpoint's weights
            self.fleet.push_weights(None, self.start_iteration)
            self.rollouts.load(self.resumed_from["path"])  # the batch ahead (overlapped rollouts)
            budget_line = self.rollouts.load_budget(self.resumed_from.get("kv_budget"))
            if budget_line is not None:
                log(f"[setup] {budget_line}")
            log(f"[setup] engine now serves the weights of iteration {self.start_iteration}")
            self.clock.mark("weights to the engine")
        engine = "" if self.engine_seconds is None else f"; engine up in {self.engine_seconds:.1f} s" + (
            f" ({self.engine.started})" if self.engine is not None else "")
        ranks = " (ranks forked from the launcher)" if forked_rank() else ""
        log(f"[setup] ready {self.clock.line()} after launch{ranks}{engine}")

    def longest_prompt_tokens(self) -> int:
        """Tokens of the longest training or held-out prompt: bounds H2O's side buffer on a GPU engine."""
        held_out = self.evaluator.prompts if self.evaluator is not None else []
        prompts = [r.prompt for r in self.dataset.records] + held_out
        return max(len(p) if isinstance(p, list) else len(encode_prompt(self.tokenizer, p)) for p in prompts)

    def begin_engine_start(self, background: bool) -> None:
        """Every engine host starts its reward scorer and, on a background thread, its engine
        (sparse_rl_mega/rollout/placement.py); :meth:`finish_engine_start` waits for it. ``background``:
        the learner is built meanwhile (only said in the log)."""
        cfg, r = self.cfg, self.cfg.rollout
        self.fleet = EngineFleet(cfg, self.rank, self.faults, log)
        on_gpu = torch.cuda.is_available()
        if self.placement is not None:
            from transformers import AutoTokenizer

            self.scorer = build_scorer(cfg.reward)  # math workers warm up while the engine starts
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            log(f"[setup] starting {len(self.fleet.placements)} SGLang engine(s) x TP {r.engine_tensor_parallel_size} "
                f"({r.placement}; KV policy {r.kv_compression.policy}, budget {r.kv_compression.budget})"
                f"{' while the learner loads' if background else ''} ...")
            kv_settings = engine_kv_settings(r.kv_compression, self.tokenizer)
            if cfg.eval.path is not None and self.rank == 0:
                self.evaluator = Evaluator(cfg, self.tokenizer, self.scorer, log)
                # dense (or another policy) for evaluation requests: the engine accepts per-request settings
                kv_settings.allow_request_override = self.evaluator.needs_request_override
            prompt_tokens = self.longest_prompt_tokens() if on_gpu else 0

            def make_start(name: str) -> EngineStart:
                return EngineStart(cfg.model.path, kv_settings, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                    max_total_tokens=r.max_total_tokens, max_running_requests=r.max_running_requests,
                    mem_fraction_static=r.mem_fraction_static, attention_backend=r.attention_backend,
                    tp_size=r.engine_tensor_parallel_size, base_gpu_id=self.placement.first_device,
                    memory_saver=self.fleet.release_memory, prompt_tokens=prompt_tokens,
                    timeout_s=r.engine_timeout_s, name=name, support_top_k=r.top_k if r.truncates else None,
                    log=log)

            self.fleet.start(make_start)

    def finish_engine_start(self) -> None:
        """Wait for this host's engine (and form the weight broadcast group); rank 0 gives the sequence
        that checks a restarted engine's weights: the first training prompt."""
        check_ids = encode_prompt(self.tokenizer, self.dataset.records[0].prompt) if self.rank == 0 else None
        self.engine_seconds = self.fleet.ready(self.learner, check_ids)

    def checkpoint_dir(self) -> Path:
        return checkpoint_folder(self.cfg)

    def maybe_resume(self) -> None:
        """Load model, optimizer and RNG from ``checkpoint.resume`` (any TP/PP layout): the newest
        checkpoint that verifies (learner/checkpoint.py)."""
        spec = self.cfg.checkpoint.resume
        if spec is None:
            return
        path = choose_resume_checkpoint(spec, self.checkpoint_dir(), log)
        if path is None:
            log(f"[setup] checkpoint.resume=auto: no checkpoint under {self.checkpoint_dir()}, starting fresh")
            return
        started = time.perf_counter()
        self.resumed_from = {**load_checkpoint(self.learner, path), "path": str(path)}
        self.start_iteration = int(self.resumed_from["iteration"])
        saved = self.resumed_from.get("layout", {})
        run = self.resumed_from.get("mlflow_run_id")
        log(f"[setup] resumed from {path} (iteration {self.start_iteration}"
            + (f" of MLflow run {run}" if run else "") + f", saved at TP={saved.get('tensor_model_parallel_size')} "
            f"PP={saved.get('pipeline_model_parallel_size')}) in {time.perf_counter() - started:.1f} s")
        changed = config_changes(self.resumed_from.get("config") or {}, self.cfg.to_dict())
        if changed and self.resumed_from.get("config"):
            shown = "; ".join(changed[:6]) + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
            log(f"[setup] config changed since that checkpoint: {shown}")
        if self.start_iteration >= self.cfg.trainer.iterations:
            log(f"[setup] trainer.iterations={self.cfg.trainer.iterations} already reached: nothing to train")

    # ------------------------------------------------------------------ phases
    def groups_of_this_rank(self, local) -> int:
        """The GRPO groups this data-parallel rank trains (``local``: its rows), each with all its samples:
        the split itself is arithmetic (:func:`sparse_rl_mega.batch.data_parallel_rows`, whose partition
        the config's batch checks guarantee: tests/test_config.py), so no collective checks it here."""
        mine = set(local.group_ids.tolist())
        rows_per_group = self.cfg.rollout.n_samples_per_prompt
        if local.size != len(mine) * rows_per_group:
            raise RuntimeError(f"data-parallel split: rank {self.dp_rank} holds {local.size} rows of groups "
                               f"{sorted(mine)}, expected all {rows_per_group} samples of each")
        return len(mine)

    def run(self) -> None:
        """The iterations, each as its phases: sample, prepare, optimise, then push, checkpoint and
        evaluate after the iterations the cadence names (cadence.py), and report."""
        cfg, cadence = self.cfg, self.cadence
        if self.evaluator is not None and cadence.evaluate_before_training(self.start_iteration):
            self.evaluate(0)
        loop_started = time.perf_counter()
        for iteration in range(self.start_iteration, cfg.trainer.iterations):
            timer, started = PhaseTimer(), time.perf_counter()
            watchdog.at_iteration(iteration)
            self.fleet.restarts = 0
            sampled = self.sample(iteration, timer)
            local, metrics = self.prepare(sampled, iteration, timer)
            metrics.update(self.optimise(local, iteration, timer))
            budget_note = self.rollouts.adapt_budget(metrics, sampled)
            trained = iteration + 1
            if cadence.push(trained, self.fleet.version):
                metrics.update(self.push(sampled.batch, iteration, timer))
            saved_line = None
            if cadence.checkpoint(trained):
                saved_line = self.checkpoint(iteration, timer, metrics)
            if self.evaluator is not None and cadence.evaluate(trained):
                with timer.phase("eval"):
                    self.evaluate(trained)
            metrics.update(timer.metrics())
            metrics["engine/restarts"] = float(self.fleet.restarts)
            metrics["time/iteration_s"] = time.perf_counter() - started
            if self.rank == 0:
                self.report(iteration, metrics, timer, sampled.example, saved_line, loop_started, budget_note)
        self.report_end(loop_started)

    def sample(self, iteration: int, timer: PhaseTimer):
        """The batch iteration ``iteration`` trains on (a rollout/overlap.py SampledBatch: every rank
        holds all of it); with ``rollout.max_staleness`` >= 1 the engines then start on the next one."""
        self.faults.at("rollout", iteration)
        sampled = self.rollouts.take(iteration, timer)
        # max_staleness >= 1: the engines now generate the next iteration's samples while this one trains
        self.rollouts.start_ahead(iteration + 1, timer)
        return sampled

    def prepare(self, sampled, iteration: int, timer: PhaseTimer):
        """GRPO advantages of the batch (unless taken per step, after rejection), this DP rank's rows
        of it and their old (and reference) logprobs. Returns those rows (a RolloutBatch of
        ``optimizer_steps_per_iteration * global_batch_size / DP`` rows) and the iteration's metrics so far."""
        cfg, algo, mbs = self.cfg, self.cfg.algorithm, self.cfg.trainer.micro_batch_size
        batch, metrics = sampled.batch, dict(sampled.metrics)
        self.faults.at("train", iteration)
        if not algo.advantage_after_rejection:
            batch.advantages = grpo_advantages(batch.rewards, cfg.rollout.n_samples_per_prompt,
                                               algo.advantage_std_normalize)
        local = batch.select(data_parallel_rows(batch.size, cfg.trainer.global_batch_size, self.dp_size,
                                                self.dp_rank))
        metrics["rollout/prompts_per_dp_rank"] = float(self.groups_of_this_rank(local))
        with timer.phase("logp_old"):
            if algo.correction.old_policy == "sampler":  # bypass: the sampler is the PPO anchor
                local.logp_old = local.logp_sparse.clone()
            else:
                local.logp_old = forward_logprobs(self.learner.chunks, local, mbs)
            if self.ref_model is not None:
                local.logp_ref = forward_logprobs(self.ref_model, local, mbs)
        return local, metrics

    def optimise(self, local, iteration: int, timer: PhaseTimer) -> dict[str, float]:
        """The optimizer steps on this rank's rows (``local``), each correcting its own global batch:
        batch normalisation and the loss normaliser span exactly the rows of that step on every DP
        rank. Returns the steps' metrics merged by their declared reductions (step_metrics.py)."""
        cfg, algo, correction = self.cfg, self.cfg.algorithm, self.cfg.algorithm.correction
        share = cfg.trainer.global_batch_size // self.dp_size
        per_step: list[dict[str, float]] = []
        for step in range(cfg.optimizer_steps_per_iteration):
            part = local.select(torch.arange(step * share, (step + 1) * share))
            part.is_weights, part.loss_mask, step_metrics = compute_correction(
                part.logp_old, part.logp_sparse, part.response_mask, correction, group=self.dp_group)
            if algo.advantage_after_rejection:
                part.advantages = grpo_advantages(part.rewards, cfg.rollout.n_samples_per_prompt,
                                                  algo.advantage_std_normalize, valid=part.loss_mask.sum(dim=1) > 0)
            step_metrics.update(advantage_metrics(part.advantages, self.dp_group))
            if cfg.rollout.max_staleness:
                step_metrics.update(metrics_by_staleness(part, iteration, cfg.rollout.max_staleness, correction,
                                                         self.dp_group))
            with timer.phase("train"):
                step_metrics.update(train_step(self.learner, part, algo, cfg.trainer.micro_batch_size))
            self.count_skipped_step(step_metrics, iteration, step)
            per_step.append(step_metrics)
        merged = merge_steps(per_step)
        # dense rollouts: the sampler is the old policy up to rounding (and staleness), so this is ~0
        # unless the learner does not recompute the distribution the engine sampled
        if cfg.rollout.kv_compression.policy == "none" and correction.old_policy == "dense":
            k3 = dense_sampler_k3(merged, cfg.rollout.max_staleness)
            if k3 is not None:
                merged["mismatch/dense_sampler_k3"] = k3
        return merged

    def push(self, batch, iteration: int, timer: PhaseTimer) -> dict[str, float]:
        """The weights after ``iteration`` to the engines, checked on the first sample of ``batch``; its
        sync/ metrics. The push waits for the batch in flight (overlapped rollouts), except with partial
        rollouts (``rollout.partial``) when no checkpoint, evaluation or end follows: the engines then
        pause what is in flight, take the weights, resume it and start the batches the bound allows."""
        trained = iteration + 1
        waits = not self.rollouts.partial or self.cadence.needs_complete_batch(trained)
        probe = None  # (a push that does not wait: its probe would queue behind the requests in flight, so
        # it is checked by version only; the probe runs at the pushes that wait and after a restart)
        if self.cfg.trainer.verify_sync and waits:
            # a fixed, fully known sequence: the first sample of this batch (prompt + response)
            length = int(batch.response_mask[0].nonzero().max()) + 2 if batch.response_mask[0].any() else 2
            probe = [int(batch.input_ids[0, 0])] + batch.labels[0, :length - 1].tolist()
        if waits:
            self.rollouts.collect(trained, timer)
        self.faults.at("sync", iteration)
        metrics = self.fleet.push_weights(probe, trained, timer)
        if not waits:
            self.rollouts.start_after_push(trained)
        return metrics

    def checkpoint(self, iteration: int, timer: PhaseTimer, metrics: dict[str, float]) -> str:
        """Save the learner (and the batch ahead) after ``iteration``; adds ``time/checkpoint_digest_s``
        to ``metrics``; returns the console's line about it."""
        cfg, trained = self.cfg, iteration + 1
        self.faults.at("checkpoint", iteration)
        with timer.phase("checkpoint"):
            extra = {"mlflow_run_id": self.tracker.run_id if self.tracker is not None else None,
                     "initial_model": cfg.model.path, "config": cfg.to_dict(),
                     "kv_budget": self.rollouts.budget_state(),  # the automatic budget's, else None
                     "config_digest": config_digest(cfg.to_dict())}
            saved, saved_bytes, digest_seconds = save_checkpoint(
                self.learner, self.checkpoint_dir(), trained, cfg.checkpoint.keep_last, extra=extra,
                rank0_extra=self.rollouts.save)
        metrics["time/checkpoint_digest_s"] = digest_seconds
        return (f"[checkpoint] iteration {trained} saved in {timer.seconds['checkpoint']:.1f} s "
                f"({saved_bytes / 2**20:.1f} MiB, digests {digest_seconds:.2f} s): {saved}")

    def evaluate(self, trained: int) -> None:
        """Rank 0: held-out accuracy of the weights the engine serves, logged at step ``trained``."""
        control = self.rollouts.budget_control if self.rollouts is not None else None
        metrics = self.evaluator.evaluate(self.engine, trained, control.budget if control is not None else None)
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=trained)

    def report(self, iteration: int, metrics: dict[str, float], timer: PhaseTimer, example: str,
               saved_line: Optional[str], loop_started: float, budget_note: Optional[str] = None) -> None:
        """Rank 0: the iteration's metrics to MLflow, its spans to the timeline, its lines to the console."""
        total = self.cfg.trainer.iterations
        self.tracker.log_metrics(metrics, step=iteration)
        self.write_timeline(iteration, timer)
        done, left = iteration + 1 - self.start_iteration, total - iteration - 1
        eta = (time.perf_counter() - loop_started) / done * left
        log(progress_line(iteration, total, metrics) + (f" | ETA {duration(eta)}" if left else ""))
        log(f"           example response: {example[:100]!r}" + (
            "  (\ufffd: bytes the model generated that form no UTF-8 character)" if "\ufffd" in example[:100] else ""))
        if budget_note is not None:
            log(f"           {budget_note}")
        self.warn_dense_mismatch(iteration, metrics)
        if saved_line is not None:
            log(saved_line)

    def warn_dense_mismatch(self, iteration: int, metrics: dict[str, float]) -> None:
        """Rank 0, once per run: the warning of :func:`step_metrics.dense_mismatch_warning`, if any."""
        if not self.warned_dense_mismatch:
            warning = dense_mismatch_warning(iteration, metrics, self.cfg.model.dtype, self.cfg.rollout)
            if warning is not None:
                self.warned_dense_mismatch = True
                log(warning)

    def report_end(self, loop_started: float) -> None:
        """The held-out before/after table, the loop's time, where the run went."""
        summary = self.evaluator.summary() if self.evaluator is not None else None
        if summary is not None:
            log(summary)
        cfg = self.cfg
        trained = max(0, cfg.trainer.iterations - self.start_iteration)
        log(f"[done] {trained} iteration(s) in {duration(time.perf_counter() - loop_started)} ({duration(time.time() - self.clock.started_at)} "
            f"since launch); run folder {Path(cfg.trainer.run_dir).resolve()}")
        if self.tracker is not None and self.tracker.enabled:
            log(f"[done] {self.tracker.how_to_open()}")

    def write_timeline(self, iteration: int, timer: PhaseTimer) -> None:
        """Rank 0: one line of ``<run_dir>/timeline.jsonl`` per iteration: the wall-clock spans of the
        learner's phases and of the engines' generations gathered during it (which overlap with
        ``rollout.max_staleness`` >= 1)."""
        row = {"iteration": iteration, "learner": [list(span) for span in timer.spans],
               "engines": [{"batch": it, "engine": e, "start": start, "end": end}
                           for it, e, start, end in self.rollouts.drain_timeline()]}
        path = Path(self.cfg.trainer.run_dir) / "timeline.jsonl"
        with path.open("a") as out:
            out.write(json.dumps(row) + "\n")

    def count_skipped_step(self, step_metrics: dict[str, float], iteration: int, step: int) -> None:
        """Count an optimizer step that ``train_step`` skipped (NaN/Inf loss or gradient norm); stop the
        job after ``trainer.max_consecutive_skips`` in a row (its last complete checkpoint stays)."""
        if not step_metrics["train/skipped_steps"]:
            self.consecutive_skips = 0
            return
        self.consecutive_skips += 1
        limit = self.cfg.trainer.max_consecutive_skips
        log(f"[train] iteration {iteration + 1}, optimizer step {step + 1}: non-finite loss "
            f"{step_metrics['train/loss']} or gradient norm {step_metrics['train/grad_norm']}: step skipped, weights "
            f"unchanged ({self.consecutive_skips} in a row, at most {limit})")
        if self.consecutive_skips >= limit:
            raise NonFiniteTraining(f"{self.consecutive_skips} optimizer steps in a row had a non-finite loss or "
                                    f"gradient norm (trainer.max_consecutive_skips={limit}); the newest complete "
                                    f"checkpoint under {self.checkpoint_dir()} is the last good state")

    def close(self, ok: bool, stopped: bool = False) -> None:
        """``stopped``: by the user (Ctrl-C): the MLflow run ends KILLED, else FAILED unless ``ok``."""
        # a failed job waits less for a tracking store that does not answer: the next launch sends the rest
        wait_s = self.cfg.tracking.flush_timeout_s if ok else min(10.0, self.cfg.tracking.flush_timeout_s)
        # shutting down waits for the tracking store and the engines, each with its bound: the watchdog's
        # (a rank stopped now would hold the others at the last barrier for the collectives' timeout)
        watchdog.enter("shutdown", bound_s=wait_s + ENGINE_CLOSE_WAIT_S + SHUTDOWN_SLACK_S)
        clock = PhaseClock()
        if self.tracker is not None:
            unsent = self.tracker.finish("FINISHED" if ok else "KILLED" if stopped else "FAILED", wait_s)
            if unsent:
                log(unsent)
            clock.mark("MLflow")
        if self.fleet is not None and self.fleet.supervisor is not None:
            # an engine still starting (set-up failed) is shut down if it comes up soon; otherwise its
            # processes die with this one (they ask for SIGKILL when it ends)
            self.fleet.close(ENGINE_CLOSE_WAIT_S)
            clock.mark("engine")
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
            clock.mark("reward workers")
        if ok:
            log(f"[done] shut down in {clock.line()}")


class NonFiniteTraining(JobWideError):
    """Too many optimizer steps in a row were skipped for a NaN/Inf loss or gradient norm."""
