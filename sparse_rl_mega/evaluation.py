"""Accuracy of the model an engine serves, dense and under KV compression, on prompt/label records.

Shared by ``tools/evaluate.py`` (a fresh engine per model) and the trainer's held-out evaluation
(the rollout engine, between iterations). Every KV setting decodes the same prompts with the same
sampling seed, so the settings differ only by the KV cache.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def request_kv(kv, policy: str, budget: int) -> dict:
    """The per-request KV settings of ``policy`` at ``budget`` with every other field of ``kv`` (a
    KVCompressionConfig: sink, window, interval, selection, shared scores and the policy's parameters,
    e.g. R-KV's kernel and lambda), whatever ``kv``'s own policy is (a dense run's section still says
    how its compressed evaluation scores)."""
    return {"policy": policy, "budget": budget, "sink": kv.sink, "window": kv.window, "interval": kv.interval,
            "selection": kv.selection, "shared_scores": kv.shared_scores, "params": kv.policy_params(policy)}


def parse_kv_variants(spec: str, rollout_kv=None) -> list[tuple[str, Optional[dict]]]:
    """``"dense,rollout,snapkv:64"`` -> ``[(label, per-request KV override or None), ...]``.

    ``dense`` / ``none``: no compression; ``POLICY:BUDGET``: that policy at that budget with every
    other field of ``rollout_kv`` (:func:`request_kv`; without ``rollout_kv``, the engine's other
    settings); ``rollout``: the engine's own settings (``rollout_kv``, a KVCompressionConfig, names the
    label; the override is None). A setting named twice ('rollout' and the same explicit setting) is
    evaluated once. Raises ValueError naming the bad item."""
    from sparse_rl_mega.kv.policies import policy_names

    out: list[tuple[str, Optional[dict]]] = []
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if len(set(items)) != len(items):
        raise ValueError(f"KV settings repeat: {items}")
    for item in items:
        if item in ("none", "dense"):
            out.append(("dense", {"policy": "none"}))
        elif item == "rollout":
            if rollout_kv is None:
                raise ValueError("'rollout' names the training rollout's KV setting; there is none here")
            label = "dense" if rollout_kv.policy == "none" else f"{rollout_kv.policy}:{rollout_kv.budget}"
            out.append((label, None))
        else:
            name, _, budget = item.partition(":")
            if name not in policy_names() or not budget.isdigit() or int(budget) <= 0:
                raise ValueError(f"{item!r}: expected dense, rollout or POLICY:BUDGET with POLICY in "
                                 f"{sorted(policy_names())} and BUDGET a positive integer")
            out.append((item, {"policy": name, "budget": int(budget)} if rollout_kv is None
                        else request_kv(rollout_kv, name, int(budget))))
    if not out:
        raise ValueError("no KV setting given")
    # 'rollout' may name a setting also listed explicitly (dense rollouts and 'dense'): evaluate it once
    unique: dict[str, Optional[dict]] = {}
    for label, override in out:
        unique.setdefault(label, override)
    return list(unique.items())


def needs_request_override(variants: list[tuple[str, Optional[dict]]]) -> bool:
    """Whether evaluating ``variants`` (:func:`parse_kv_variants`) needs an engine that accepts
    per-request KV settings (any setting other than the rollout's own)."""
    return any(override is not None for _, override in variants)


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
