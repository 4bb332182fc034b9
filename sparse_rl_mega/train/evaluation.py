"""Accuracy of the model an engine serves, dense and under KV compression, on prompt/label records.

Shared by ``tools/evaluate.py`` (a fresh engine per model) and the trainer's held-out evaluation
(:class:`Evaluator`: the rollout engine, between iterations). Every KV setting decodes the same prompts with the same
sampling seed, so the settings differ only by the KV cache.
"""
from __future__ import annotations

import math
import time
from typing import Optional
from collections.abc import Callable, Sequence

from sparse_rl_mega.config.evaluation import AUTO, needs_request_override, parse_kv_variants
from sparse_rl_mega.data.formatting import encode_prompt
from sparse_rl_mega.data.jsonl import PromptDataset


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (sample standard deviation / sqrt(n)); 0 for n < 2."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def scalar_items(row: dict) -> dict[str, float]:
    """The numeric entries of an evaluation row (what is logged as metrics)."""
    return {key: float(value) for key, value in row.items() if isinstance(value, (int, float))}


def evaluate_on_engine(engine, prompts_ids: Sequence[Sequence[int]], labels: Sequence[str], scorer,
                       variants: list[tuple[str, Optional[dict]]], *, n_samples: int, max_new_tokens: int,
                       temperature: float, top_p: float = 1.0, seed: int = 0,
                       log: Optional[Callable[[str], None]] = None, name: str = "eval") -> dict[str, dict]:
    """Decode every prompt ``n_samples`` times under each KV variant; returns per variant label:
    ``mean_at_k`` (mean correctness of all samples), ``pass_at_k``, ``response_tokens_mean``,
    ``mean_at_k_stderr`` (standard error of ``mean_at_k`` over problems), ``truncated_fraction``,
    ``boxed_fraction``, ``evicted_tokens_per_sample``, ``problems``, ``samples_per_problem``, ``seconds``
    and ``correct_per_problem`` (correct samples of each prompt, in prompt order)."""
    results: dict[str, dict] = {}
    k = n_samples
    for label, override in variants:
        started = time.perf_counter()
        evicted_before = engine.kv_stats().get("evicted_tokens", 0)
        samples = engine.generate(prompts_ids, k, max_new_tokens, temperature, top_p, seed=seed, kv_override=override)
        evicted = engine.kv_stats().get("evicted_tokens", 0) - evicted_before
        verdicts, boxed = scorer.judge([s.response_text for s in samples], [labels[s.prompt_index] for s in samples])
        correct = [0] * len(prompts_ids)
        for sample, ok in zip(samples, verdicts):
            correct[sample.prompt_index] += int(ok)
        row = {
            "problems": len(prompts_ids), "samples_per_problem": k,
            "mean_at_k": sum(correct) / (k * len(prompts_ids)),
            "mean_at_k_stderr": mean_stderr([c / k for c in correct]),
            "pass_at_k": sum(pass_at_k(k, c, k) for c in correct) / len(prompts_ids),
            "response_tokens_mean": sum(len(s.response_ids) for s in samples) / len(samples),
            "truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "boxed_fraction": sum(boxed) / len(samples),
            "evicted_tokens_per_sample": evicted / len(samples),
            "seconds": time.perf_counter() - started,
            "correct_per_problem": correct,  # a list: kept in eval files, not logged as a metric
        }
        results[label] = row
        if log is not None:
            log(f"[{name}] {label}: mean@{k} {row['mean_at_k']:.3f}, pass@{k} {row['pass_at_k']:.3f} over "
                f"{len(prompts_ids)} problems ({row['response_tokens_mean']:.0f} tokens/response, "
                f"{row['evicted_tokens_per_sample']:.1f} evicted/sample, {row['seconds']:.0f} s)")
    return results


class Evaluator:
    """Rank 0 of a training run with an ``eval`` section: held-out accuracy of the weights the rollout
    engine serves, before training and after the iterations the cadence (cadence.py) names. Keeps
    every result (``<run_dir>/eval.json``) and prints a before/after table at the end."""

    def __init__(self, cfg, tokenizer, scorer, log: Callable[[str], None] = print):
        """``cfg``: the run's config (its ``eval`` section says what to evaluate); ``scorer``: the
        rollout's reward scorer, which judges the answers."""
        self.cfg, self.scorer, self.log = cfg, scorer, log
        e = cfg.eval
        records = PromptDataset(e.path).records
        records = records[:e.limit] if e.limit else records
        if not records:
            raise ValueError(f"eval.path {e.path}: no rows to evaluate")
        self.prompts: list[list[int]] = [encode_prompt(tokenizer, r.prompt) for r in records]  # token ids
        self.labels: list[str] = [r.label for r in records]
        self.variants = parse_kv_variants(e.kv, cfg.rollout.kv_compression)  # [(label, KV override or None)]
        self.history: list[dict] = []  # {"iteration": trained iterations, "results": {label: row}} per evaluation
        log(f"[setup] held-out evaluation: {len(records)} problems of {e.path} x {e.n_samples} samples, "
            f"KV settings {', '.join(label for label, _ in self.variants)}")

    @property
    def needs_request_override(self) -> bool:
        """Whether the engine must accept per-request KV settings (dense or another policy)."""
        return needs_request_override(self.variants)

    def evaluate(self, engine, trained_iterations: int, rollout_budget: Optional[int] = None) -> dict[str, float]:
        """Held-out accuracy of the weights ``engine`` serves (``rollout_budget``: the automatic budget
        in force, for the ``POLICY:auto`` setting); returns ``eval/<setting>/<figure>`` metrics and
        rewrites ``<run_dir>/eval.json`` with every evaluation so far."""
        import json
        from pathlib import Path

        e = self.cfg.eval
        variants = [(label, {"budget": rollout_budget} if override is AUTO else override)
                    for label, override in self.variants]
        results = evaluate_on_engine(
            engine, self.prompts, self.labels, self.scorer, variants,
            n_samples=e.n_samples, max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
            temperature=e.temperature, top_p=e.top_p, seed=e.seed, log=self.log,
            name=f"eval after {trained_iterations} iteration(s)")
        engine.flush_cache()  # the next rollout must not depend on what evaluation left cached
        self.history.append({"iteration": trained_iterations, "results": results,
                             **({"rollout_budget": rollout_budget} if rollout_budget is not None else {})})
        path = Path(self.cfg.trainer.run_dir) / "eval.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"path": e.path, "n_samples": e.n_samples, "temperature": e.temperature,
                                    "history": self.history}, indent=2))
        return {f"eval/{label.replace(':', '_')}/{key}": value
                for label, row in results.items() for key, value in scalar_items(row).items()}

    def summary(self) -> Optional[str]:
        """Before/after table of the first and the last evaluation; None before a second one."""
        if len(self.history) < 2:
            return None
        first, last = self.history[0], self.history[-1]
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
