"""The automatic KV budget's law (sparse_rl_mega/kv/auto_budget.py) on scripted measurements and on a
simulated task with a sharp threshold, sampled with and without a batch ahead; its config section. That
the engines keep each rollout's budget and a resumed run continues the schedule: tests/test_resume.py."""
from __future__ import annotations

import math

import pytest

from sparse_rl_mega.config import ConfigError, load_config
from sparse_rl_mega.kv.auto_budget import BudgetController
from tests.conftest import ROOT

pytestmark = pytest.mark.unit

OK, BAD = -0.1, -2.0  # log rho p5 within the target (log 0.5 = -0.69) and far below it


def controller(start: int = 40) -> BudgetController:
    return BudgetController(low=32, high=56, start=start, quantile=5, min_rho=0.5, increase=8, decrease=2)


def test_raises_on_a_violation_decays_otherwise_and_stays_within_bounds():
    c = controller()
    script = [  # (log rho p5, budget the batch was sampled at) -> the budget after, by the law's words
        (OK, 40, 38), (OK, 38, 36),
        (BAD, 36, 44),           # violation: 8 above the budget that was too tight
        (OK, 44, 42),
        (float("nan"), 42, 42),  # no response token measured: unchanged
        (BAD, 36, 44),           # a batch sampled ahead at 36 violates: 36 + 8, not 42 + 8
        (BAD, 30, 44),           # nor is the budget lowered by an older, smaller batch
        (BAD, 52, 56), (BAD, 56, 56),  # capped at max
    ]
    for value, sampled_at, expected in script:
        step = c.update({"mismatch/log_rho_p5": value}, sampled_at)
        assert step.budget == c.budget == expected, (value, sampled_at, step)
        assert step.violated == (value == BAD)
    for _ in range(20):  # within the target from the top: down by 2 to the floor, never below
        c.update({"mismatch/log_rho_p5": OK}, c.budget)
    assert c.budget == 32
    # the boundary: exactly log(min_rho) is within the target
    assert not c.update({"mismatch/log_rho_p5": math.log(0.5)}, 32).violated
    # the signal is the configured quantile
    p1 = BudgetController(32, 56, 40, quantile=1, min_rho=0.5, increase=8, decrease=2)
    assert p1.update({"mismatch/log_rho_p5": BAD, "mismatch/log_rho_p1": OK}, 40).budget == 38


@pytest.mark.parametrize("ahead", [0, 1])
def test_oscillation_around_a_sharp_threshold_is_bounded(ahead):
    """Budgets below ``b*`` = 45 violate, others do not. Batches are started ``ahead`` iterations before
    the update that reads them (``rollout.max_staleness``): after the budget first reaches ``b*`` every
    batch is sampled in ``[b* - (ahead + 1) * decrease, b* + increase)``, and the violations are at most
    ``ahead + 1`` in each stretch of ``increase / decrease + ahead + 1`` batches."""
    threshold, iterations = 45, 200
    c = controller(start=56)
    started = [c.budget] * (ahead + 1)  # batches 0..ahead start with the first budget
    sampled, violations = [], []
    for i in range(iterations):
        at = started[i]
        violated = at < threshold
        c.update({"mismatch/log_rho_p5": BAD if violated else OK}, at)
        started.append(c.budget)  # the batch started after this update: i + ahead + 1
        sampled.append(at)
        violations.append(violated)
    settled = next(i for i, b in enumerate(sampled) if b < threshold)
    tail = sampled[settled:]
    assert min(tail) >= threshold - (ahead + 1) * 2 and max(tail) < threshold + 8, tail
    period = 8 // 2 + ahead + 1
    window = violations[settled:]
    assert all(sum(window[k:k + period]) <= ahead + 1 for k in range(len(window) - period)), window


def test_config_section(tmp_path):
    base = ROOT / "examples" / "cpu_tiny.yaml"
    key = "rollout.kv_compression.auto_budget"
    cfg = load_config(base, [f"{key}.min=8", f"{key}.max=20"])
    auto = cfg.rollout.kv_compression.auto_budget
    assert (auto.step_up, auto.step_down) == (4, 1)  # a third of the range up, a quarter of that down
    assert cfg.rollout.kv_compression.largest_budget == 20  # engines and memory are sized for max
    c = BudgetController.from_config(cfg.rollout.kv_compression)
    assert (c.low, c.high, c.budget, c.signal) == (8, 20, 12, "mismatch/log_rho_p5")
    assert BudgetController.from_config(load_config(base).rollout.kv_compression) is None
    dense = load_config(base, [f"{key}.min=8", f"{key}.max=20", "rollout.kv_compression.policy=none"])
    assert BudgetController.from_config(dense.rollout.kv_compression) is None  # (an ablation's dense variant)
    bad = {  # override -> the key the error names, and what it says
        (f"{key}.min=4", f"{key}.max=20"): f"{key}.min: budget 4 must exceed sink + window = 6",
        (f"{key}.max=20",): f"{key}.min: required",
        (f"{key}.min=14", f"{key}.max=20"): "rollout.kv_compression.budget: 12 is where the automatic budget starts",
        (f"{key}.min=8", f"{key}.max=10"): "rollout.kv_compression.budget: 12 is where",
        (f"{key}.min=8", f"{key}.max=20", f"{key}.quantile=50"): f"{key}.quantile: must be one of the measured",
        (f"{key}.min=8", f"{key}.max=20", f"{key}.min_rho=1.5"): f"{key}.min_rho: must be in (0, 1)",
        (f"{key}.min=8", f"{key}.max=20", f"{key}.decrease=0"): f"{key}.decrease: must be >= 1 token",
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError, match=None) as caught:
            load_config(base, list(overrides))
        assert message in str(caught.value), (overrides, str(caught.value))


def test_an_engine_takes_a_smaller_budget_per_request_without_overrides():
    """Engines of an automatic budget start at its max and take each rollout's budget per request; any
    other per-request setting still needs allow_request_override (sparse_rl_mega/kv/engine_settings.py)."""
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings

    engine = EngineKVSettings(policy="rkv", budget=20, sink=2, window=4, interval=2)
    assert engine.refusal({"budget": 12}) is None and engine.refusal({"budget": 20}) is None
    assert engine.updated({"budget": 12}).budget == 12
    for override in ({"budget": 24}, {"budget": 0}, {"budget": 12, "window": 2}, {"policy": "none"}):
        assert "a request may only lower its budget (at most 20)" in engine.refusal(override), override
    assert EngineKVSettings(policy="rkv", budget=20, allow_request_override=True).refusal({"policy": "none"}) is None
