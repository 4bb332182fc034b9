"""The Sparse-RL loop, run by every torchrun rank.

One iteration:
  rollout (rank 0's SGLang engine, KV evicted per request) -> reward (exact answer or math-verify) -> GRPO advantages
  -> dense ``logp_old`` from the Megatron learner -> correction (veto, token rejection, IS weights)
  -> optimizer step(s) with the corrected PPO loss -> engine weights resynced from the learner shards
  -> (optionally) held-out accuracy on the engine, dense and sparse -> metrics to MLflow and the console.
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from sparse_rl_mega.config import RunConfig


def log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{name}_s": value for name, value in self.seconds.items()}


def ensure_model(cfg: RunConfig) -> None:
    """Build the tiny local model on rank 0 when the config asks for it and it is missing."""
    if Path(cfg.model.path, "config.json").is_file():
        return
    if cfg.model.create_tiny is None:
        raise FileNotFoundError(f"model.path {cfg.model.path}: no HF model folder (config.json) there")
    from sparse_rl_mega.models.tiny import build_tiny_model

    build_tiny_model(cfg.model.path, cfg.model.arch, cfg.model.create_tiny, cfg.data.train_path,
                     cfg.data.prompt_key, cfg.data.label_key, log=log)


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.engine = None
        self.tracker = None
        self.scorer = None  # rank 0: the reward scorer (math: a pool of checking processes)
        self.ref_model = None
        self.start_iteration = 0
        self.resumed_from: Optional[dict] = None  # the checkpoint marker when resuming

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from megatron.core import parallel_state as ps

        from sparse_rl_mega.data.jsonl import load_prompt_dataset
        from sparse_rl_mega.learner.cpu_shims import seed_model_parallel_rng
        from sparse_rl_mega.learner.model import build_learner
        from sparse_rl_mega.learner.weights import load_hf_into_model

        cfg = self.cfg
        p = cfg.parallel
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tensor_model_parallel_size,
                                     pipeline_model_parallel_size=p.pipeline_model_parallel_size)
        seed_model_parallel_rng(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dataset = load_prompt_dataset(cfg.data, default_tokenizer=cfg.model.path)

        if self.rank == 0:
            ensure_model(cfg)
        dist.barrier()
        self.learner = build_learner(cfg)
        load_hf_into_model(self.learner.module, cfg.model.path, cfg.model.arch)
        if cfg.algorithm.kl_coef > 0:  # frozen reference policy = the initial weights
            from sparse_rl_mega.learner.model import build_reference_model

            self.ref_model = build_reference_model(cfg)
            load_hf_into_model(self.ref_model, cfg.model.path, cfg.model.arch)
        log(f"[setup] learner TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
            f"DP={self.dp_size}; weights loaded from {cfg.model.path}")
        self.maybe_resume()

        if self.rank == 0:
            from transformers import AutoTokenizer

            from sparse_rl_mega.reward import build_scorer
            from sparse_rl_mega.rollout.engine import RolloutEngine, engine_kv_settings
            from sparse_rl_mega.tracking import Tracker

            self.scorer = build_scorer(cfg.reward)  # math workers warm up while the engine starts
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
            r = cfg.rollout
            started = time.perf_counter()
            log(f"[setup] starting SGLang engine (KV policy {r.kv_compression.policy}, "
                f"budget {r.kv_compression.budget}) ...")
            kv_settings = engine_kv_settings(r.kv_compression, self.tokenizer)
            if cfg.eval.path is not None:
                self.setup_eval()
                # dense (or another policy) for evaluation requests: the engine accepts per-request settings
                kv_settings.allow_request_override = any(o is not None for _, o in self.eval_variants)
            self.engine = RolloutEngine(cfg.model.path, kv_settings,
                                        dtype=cfg.model.dtype,
                                        seed=cfg.trainer.seed, max_total_tokens=r.max_total_tokens,
                                        max_running_requests=r.max_running_requests,
                                        mem_fraction_static=r.mem_fraction_static,
                                        attention_backend=r.attention_backend, tp_size=r.engine_tensor_parallel_size)
            log(f"[setup] engine up in {time.perf_counter() - started:.1f} s")
            if cfg.trainer.sync_method == "broadcast":
                from sparse_rl_mega.ports import free_port

                self.engine.connect_weight_group("127.0.0.1", free_port(),
                                                 backend="gloo" if not torch.cuda.is_available() else "nccl")
                log("[setup] weight-update group joined (broadcast sync)")
            resume_run = (self.resumed_from or {}).get("mlflow_run_id")
            self.tracker = Tracker(cfg, resume_run_id=resume_run)
            if self.tracker.enabled:
                how = "continued" if self.tracker.continued else "started"
                log(f"[setup] MLflow run {self.tracker.run_id} {how} at {self.tracker.tracking_uri}")
        dist.barrier()
        if self.resumed_from is not None:  # the engine loaded model.path: give it the checkpoint's weights
            self.sync_weights(PhaseTimer(), None)
            log(f"[setup] engine now serves the weights of iteration {self.start_iteration}")

    def setup_eval(self) -> None:
        """Rank 0: the held-out prompts and KV settings of ``eval``."""
        from sparse_rl_mega.data.formatting import encode_prompt
        from sparse_rl_mega.data.jsonl import PromptDataset
        from sparse_rl_mega.evaluation import parse_kv_variants

        e = self.cfg.eval
        records = PromptDataset(e.path).records
        records = records[:e.limit] if e.limit else records
        if not records:
            raise ValueError(f"eval.path {e.path}: no rows to evaluate")
        self.eval_prompts = [encode_prompt(self.tokenizer, r.prompt) for r in records]
        self.eval_labels = [r.label for r in records]
        self.eval_variants = parse_kv_variants(e.kv, self.cfg.rollout.kv_compression)
        self.eval_history: list[dict] = []
        log(f"[setup] held-out evaluation: {len(records)} problems of {e.path} x {e.n_samples} samples, "
            f"KV settings {', '.join(label for label, _ in self.eval_variants)}")

    def evaluate(self, trained_iterations: int) -> dict[str, float]:
        """Rank 0: held-out accuracy of the weights the engine serves; returns ``eval/...`` metrics and
        appends to ``<run_dir>/eval.json``."""
        from sparse_rl_mega.evaluation import evaluate_on_engine

        e = self.cfg.eval
        results = evaluate_on_engine(
            self.engine, self.eval_prompts, self.eval_labels, self.scorer, self.eval_variants,
            n_samples=e.n_samples, max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            temperature=e.temperature, top_p=e.top_p, seed=e.seed, log=log, name=f"eval after {trained_iterations} iteration(s)")
        self.engine.flush_cache()  # the next rollout must not depend on what evaluation left cached
        self.eval_history.append({"iteration": trained_iterations, "results": results})
        path = Path(self.cfg.trainer.run_dir) / "eval.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"path": e.path, "n_samples": e.n_samples, "temperature": e.temperature,
                                    "history": self.eval_history}, indent=2))
        metrics = {f"eval/{label.replace(':', '_')}/{key}": float(value)
                   for label, row in results.items() for key, value in row.items()}
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=trained_iterations)
        return metrics

    def eval_summary(self) -> str:
        """Before/after table of the first and the last evaluation."""
        first, last = self.eval_history[0], self.eval_history[-1]
        e = self.cfg.eval
        problems = next(iter(first["results"].values()))["problems"]
        lines = [f"[eval] held-out accuracy, mean@{e.n_samples} over {problems} problems of {e.path} "
                 f"(temperature {e.temperature}):",
                 f"  {'KV setting':<16}{'after ' + str(first['iteration']) + ' it.':>14}"
                 f"{'after ' + str(last['iteration']) + ' it.':>14}{'change':>10}"]
        for label in first["results"]:
            before, after = first["results"][label]["mean_at_k"], last["results"][label]["mean_at_k"]
            lines.append(f"  {label:<16}{before:>14.3f}{after:>14.3f}{after - before:>+10.3f}")
        return "\n".join(lines)

    def checkpoint_dir(self) -> Path:
        return Path(self.cfg.checkpoint.dir or Path(self.cfg.trainer.run_dir) / "checkpoints")

    def maybe_resume(self) -> None:
        """Load model, optimizer and RNG from ``checkpoint.resume`` (any TP/PP layout)."""
        from sparse_rl_mega.learner.checkpoint import find_checkpoint, load_checkpoint

        spec = self.cfg.checkpoint.resume
        if spec is None:
            return
        path = find_checkpoint(spec, self.checkpoint_dir())
        if path is None:
            log(f"[setup] checkpoint.resume=auto: no checkpoint under {self.checkpoint_dir()}, starting fresh")
            return
        started = time.perf_counter()
        self.resumed_from = load_checkpoint(self.learner, path)
        self.start_iteration = int(self.resumed_from["iteration"])
        saved = self.resumed_from.get("layout", {})
        log(f"[setup] resumed from {path} (iteration {self.start_iteration}, saved at TP="
            f"{saved.get('tensor_model_parallel_size')} PP={saved.get('pipeline_model_parallel_size')}) "
            f"in {time.perf_counter() - started:.1f} s")
        if self.start_iteration >= self.cfg.trainer.iterations:
            log(f"[setup] trainer.iterations={self.cfg.trainer.iterations} already reached: nothing to train")

    # ------------------------------------------------------------------ phases
    def rollout(self, iteration: int, timer: PhaseTimer):
        """Rank 0: generate and score; everyone: receive the packed batch."""
        from sparse_rl_mega.batch import pack_samples
        from sparse_rl_mega.data.formatting import encode_prompt

        cfg = self.cfg
        payload = [None]
        if self.rank == 0:
            records = self.dataset.batch(iteration, cfg.data.prompts_per_iteration, cfg.data.seed, cfg.data.shuffle)
            prompts_ids = [encode_prompt(self.tokenizer, r.prompt) for r in records]
            with timer.phase("rollout"):
                stats_before = self.engine.kv_stats()
                samples = self.engine.generate(prompts_ids, cfg.rollout.n_samples_per_prompt,
                                               cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                               cfg.rollout.top_p, seed=cfg.trainer.seed * 100_003 + iteration * 7919)
                stats_after = self.engine.kv_stats()
            stale = {s.weight_version for s in samples} - {str(self.engine.weight_version)}
            if stale:  # a sample generated with other weights than the learner's last push
                raise RuntimeError(f"rollout samples report weight version(s) {sorted(stale)}, "
                                   f"expected {self.engine.weight_version}")
            with timer.phase("reward"):
                rewards = self.scorer.score([s.response_text for s in samples],
                                            [records[s.prompt_index].label for s in samples])
            batch = pack_samples(samples, rewards, pad_id=self.tokenizer.pad_token_id or 0)
            response_lens = [len(s.response_ids) for s in samples]
            per_sample = self.per_sample_compression(samples)
            delta = {key: float(stats_after.get(key, 0) - stats_before.get(key, 0))
                     for key in ("evicted_tokens", "compactions", "freed_slots")}
            evicted = delta["evicted_tokens"]
            payload = [(batch, {
                "reward/mean": float(batch.rewards.mean()),
                **self.scorer.last_stats.metrics("reward/"),
                "rollout/weight_version": float(self.engine.weight_version),
                "rollout/response_len_mean": sum(response_lens) / len(response_lens),
                "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
                "kv/evicted_tokens": evicted,
                "kv/evicted_tokens_per_sample": evicted / len(samples),
                "kv/evicted_tokens_per_sample_max": float(max(e for _, e in per_sample)),
                "kv/compressions_per_sample": sum(c for c, _ in per_sample) / len(samples),
                "kv/compactions": delta["compactions"],
                "kv/freed_slots": delta["freed_slots"],
                "kv/peak_slots_in_use": float(stats_after.get("peak_slots_in_use", 0)),
                "kv/pool_size": float(stats_after.get("pool_size", 0)),
            }, samples[0].response_text)]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def per_sample_compression(self, samples) -> list[tuple[int, int]]:
        """``(compressions, evicted tokens)`` of each sample, replayed from its lengths."""
        from sparse_rl_mega.kv.policies import POLICIES, compression_schedule

        kv = self.cfg.rollout.kv_compression
        if kv.policy == "none":
            return [(0, 0)] * len(samples)
        needed = kv.window if POLICIES[kv.policy].queries_needed else 0
        newlines = set(self.engine.kv.newline_token_ids)
        return [compression_schedule(len(s.prompt_ids), len(s.response_ids), kv.budget, kv.interval, needed,
                                     [t in newlines for t in s.response_ids]) for s in samples]

    def local_indices(self, batch_size: int) -> torch.Tensor:
        """Rows of the rollout batch this DP rank trains on: for optimizer step k, slice r of the
        k-th global batch. The same global rows form step k for any DP size."""
        g = self.cfg.trainer.global_batch_size
        share = g // self.dp_size
        rows = [torch.arange(k * g + self.dp_rank * share, k * g + (self.dp_rank + 1) * share)
                for k in range(batch_size // g)]
        return torch.cat(rows)

    def sync_weights(self, timer: PhaseTimer, probe_ids: Optional[list[int]]) -> dict[str, float]:
        """Push the learner's shards to the engine as HF tensors, streamed layer by layer into buckets
        (every rank takes part: the pieces travel to rank 0); optionally check the result."""
        from sparse_rl_mega.learner.weights import buckets, stream_hf_tensors

        cfg = self.cfg
        metrics: dict[str, float] = {}
        check = probe_ids is not None
        learner_logp = self.probe_logprobs(probe_ids) if check else None  # every rank takes part
        if self.rank == 0 and check:
            metrics["sync/pre_sync_max_abs_logprob_diff"] = _max_abs_diff(self.engine.dense_logprobs(probe_ids),
                                                                          learner_logp)
        with timer.phase("sync"):
            stream = stream_hf_tensors(self.learner.module, cfg.model.arch)
            if self.rank == 0:
                dtype = torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16
                sent: list[int] = []  # bytes of each tensor pushed, for the metrics

                def counted(named):
                    for name, tensor in named:
                        sent.append(tensor.numel() * dtype.itemsize)
                        yield name, tensor
                parts = buckets(counted(stream), int(cfg.trainer.sync_bucket_mb * 2**20), dtype)
                push = self.engine.update_weights_broadcast if cfg.trainer.sync_method == "broadcast" \
                    else self.engine.update_weights
                version = push(parts)
                served = self.engine.served_weight_version()
                if served != str(version):
                    raise RuntimeError(f"after the weight sync the engine serves version {served}, expected {version}")
                metrics["sync/weight_version"] = float(version)
                metrics["sync/bytes"] = float(sum(sent))
                metrics["sync/tensors"] = float(len(sent))
            else:
                for _ in stream:  # send this rank's pieces
                    pass
        if self.rank == 0 and check:
            metrics["sync/max_abs_logprob_diff"] = _max_abs_diff(self.engine.dense_logprobs(probe_ids), learner_logp)
            self.engine.flush_cache()  # the probe's prefix must not serve the next rollout
        return metrics

    def probe_logprobs(self, probe_ids: list[int]) -> list[float]:
        """The learner's dense logprobs of ``probe_ids[1:]`` (every rank takes part)."""
        from sparse_rl_mega.batch import RolloutBatch
        from sparse_rl_mega.learner.step import forward_logprobs

        ids = torch.tensor([probe_ids])
        one = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=torch.ones(1, ids.shape[1] - 1),
                           logp_sparse=torch.zeros(1, ids.shape[1] - 1), rewards=torch.zeros(1),
                           group_ids=torch.zeros(1, dtype=torch.long))
        return forward_logprobs(self.learner.model, one, 1)[0].tolist()

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        from sparse_rl_mega.algo.advantages import grpo_advantages
        from sparse_rl_mega.algo.correction import compute_correction
        from sparse_rl_mega.learner.step import forward_logprobs, train_step

        cfg = self.cfg
        algo, correction = cfg.algorithm, cfg.algorithm.correction
        group_size, mbs = cfg.rollout.n_samples_per_prompt, cfg.trainer.micro_batch_size
        evaluating = cfg.eval.path is not None and self.rank == 0
        if evaluating and self.start_iteration == 0:
            self.evaluate(0)
        for iteration in range(self.start_iteration, cfg.trainer.iterations):
            timer = PhaseTimer()
            started = time.perf_counter()
            batch, metrics, example = self.rollout(iteration, timer)
            if not algo.advantage_after_rejection:
                batch.advantages = grpo_advantages(batch.rewards, group_size, algo.advantage_std_normalize)
            local = batch.select(self.local_indices(batch.size))
            with timer.phase("logp_old"):
                if correction.old_policy == "sampler":  # bypass: the sampler is the PPO anchor
                    local.logp_old = local.logp_sparse.clone()
                else:
                    local.logp_old = forward_logprobs(self.learner.model, local, mbs)
                if self.ref_model is not None:
                    local.logp_ref = forward_logprobs(self.ref_model, local, mbs)

            # Each optimizer step's global batch is corrected on its own: batch normalisation and the
            # loss normaliser span exactly the rows of that step on every DP rank.
            share = cfg.trainer.global_batch_size // self.dp_size
            per_step: list[dict[str, float]] = []
            for step in range(cfg.optimizer_steps_per_iteration):
                part = local.select(torch.arange(step * share, (step + 1) * share))
                part.is_weights, part.loss_mask, step_metrics = compute_correction(
                    part.logp_old, part.logp_sparse, part.response_mask, correction, group=self.dp_group)
                if algo.advantage_after_rejection:
                    part.advantages = grpo_advantages(part.rewards, group_size, algo.advantage_std_normalize,
                                                      valid=part.loss_mask.sum(dim=1) > 0)
                step_metrics.update(advantage_metrics(part.advantages, self.dp_group))
                with timer.phase("train"):
                    step_metrics.update(train_step(self.learner, part, algo, mbs, self.dp_group))
                per_step.append(step_metrics)
            for key in per_step[0]:
                values = [m[key] for m in per_step]
                if key.endswith("max"):
                    metrics[key] = max(values)
                elif key.endswith("/min"):
                    metrics[key] = min(values)
                else:
                    metrics[key] = sum(values) / len(values)

            probe = None
            if cfg.trainer.verify_sync:
                # a fixed, fully known sequence: the first sample of this batch (prompt + response)
                length = int(batch.response_mask[0].nonzero().max()) + 2 if batch.response_mask[0].any() else 2
                probe = [int(batch.input_ids[0, 0])] + batch.labels[0, :length - 1].tolist()
            metrics.update(self.sync_weights(timer, probe))

            if cfg.checkpoint.save_interval and (iteration + 1) % cfg.checkpoint.save_interval == 0:
                from sparse_rl_mega.learner.checkpoint import save_checkpoint

                with timer.phase("checkpoint"):
                    extra = {"mlflow_run_id": self.tracker.run_id if self.tracker is not None else None,
                             "initial_model": cfg.model.path, "config": cfg.to_dict()}
                    save_checkpoint(self.learner, self.checkpoint_dir(), iteration + 1, cfg.checkpoint.keep_last,
                                    extra=extra)

            trained = iteration + 1
            if evaluating and ((cfg.eval.interval and trained % cfg.eval.interval == 0)
                               or trained == cfg.trainer.iterations):
                with timer.phase("eval"):
                    self.evaluate(trained)

            metrics.update(timer.metrics())
            metrics["time/iteration_s"] = time.perf_counter() - started
            if self.rank == 0:
                self.tracker.log_metrics(metrics, step=iteration)
                log(_progress_line(iteration, cfg.trainer.iterations, metrics))
                log(f"           example response: {example[:100]!r}")
        if evaluating and len(self.eval_history) > 1:
            log(self.eval_summary())
        log(f"[done] {cfg.trainer.iterations} iteration(s); run folder {Path(cfg.trainer.run_dir).resolve()}")

    def close(self, ok: bool) -> None:
        if self.tracker is not None:
            self.tracker.finish("FINISHED" if ok else "FAILED")
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None


def advantage_metrics(advantages: torch.Tensor, group) -> dict[str, float]:
    """Mean, std, min, max and zero fraction of the advantages of a global batch (reduced over DP)."""
    adv = advantages.double()
    sums = torch.stack([adv.sum(), adv.pow(2).sum(), torch.tensor(float(adv.numel()), dtype=torch.float64),
                        (adv == 0).double().sum()])
    extremes = torch.stack([adv.max(), -adv.min()])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    total, squares, count, zeros = sums.tolist()
    mean = total / count
    return {"advantage/mean": mean, "advantage/std": max(squares / count - mean * mean, 0.0) ** 0.5,
            "advantage/max": float(extremes[0]), "advantage/min": -float(extremes[1]),
            "advantage/zero_fraction": zeros / count}


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise RuntimeError(f"logprob lengths differ: engine {len(a)} vs learner {len(b)}")
    return max(abs(x - y) for x, y in zip(a, b))


def _progress_line(iteration: int, total: int, m: dict[str, float]) -> str:
    return (f"[iter {iteration + 1}/{total}] reward {m['reward/mean']:.3f} | loss {m['train/loss']:+.4f} | "
            f"veto {m['correction/veto_fraction']:.3f} rej {m['correction/token_rejected_fraction']:.3f} | "
            f"IS mean {m['correction/is_weight_mean']:.3f} max {m['correction/is_weight_max']:.2f} | "
            f"k3 {m['mismatch/k3']:.4f} | evicted/sample {m['kv/evicted_tokens_per_sample']:.1f} "
            f"peak KV {m['kv/peak_slots_in_use']:.0f} | sync diff {m.get('sync/max_abs_logprob_diff', float('nan')):.1e} | "
            f"{m['time/iteration_s']:.1f} s")


def run_training(cfg: RunConfig) -> None:
    """Entry point for one torchrun rank (``tools/launch.py`` calls it)."""
    from sparse_rl_mega.learner.cpu_shims import apply_if_cpu

    on_cpu = apply_if_cpu()
    torch.set_num_threads(cfg.trainer.torch_threads)
    if cfg.rollout.num_engines != 1 or cfg.rollout.placement != "colocated":
        raise SystemExit("this build trains with one colocated engine owned by rank 0 "
                         "(rollout.num_engines: 1, rollout.placement: colocated)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.world_size:
        raise SystemExit(f"torchrun started {world} processes but the config's parallel section describes "
                         f"{cfg.world_size} (nnodes x nproc_per_node)")
    dist.init_process_group(backend="gloo" if on_cpu else "nccl")
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    trainer = Trainer(cfg)
    ok = False
    try:
        trainer.setup()
        trainer.run()
        ok = True
    finally:
        trainer.close(ok)
        if dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()
    sys.stdout.flush()
