"""The automatic KV budget (``rollout.kv_compression.auto_budget``, docs/algorithm.md "The automatic
budget"): the budget of the next rollout, set from the mismatch the correction measured on the last.

The signal is the lower tail of ``rho = pi_old / pi_sparse`` over the response tokens: the
``quantile``-percent quantile of ``log rho`` (``mismatch/log_rho_p{quantile}``, computed on every rank
from one all-reduced histogram, whatever the correction preset). A rollout *violates* the target when
that quantile is below ``log(min_rho)``: more than ``quantile`` % of its tokens were made at least
``1 / min_rho`` times likelier by the compressed cache than the dense policy finds them, the side the
eviction causes (most rejected tokens fall there, docs/results.md).

The law (pure arithmetic on integers, so every rank computes the same budgets):

* violation by a batch sampled at budget ``b_s``: ``b <- min(max, max(b, b_s + increase))``: at least
  ``increase`` above the budget that was too tight (relative to ``b_s``, so a batch sampled ahead with
  an older budget does not push the budget up twice for one measurement);
* otherwise: ``b <- max(min, b - decrease)``;
* no measurement (no response token): ``b`` unchanged.

With a sharp threshold ``b*`` (budgets below it violate, those above do not) and measurements that
arrive ``d`` iterations after their batch was started (``d = rollout.max_staleness``), the budget
settles into ``[b* - (d + 1) * decrease, b* + increase)`` and at most one iteration in
``increase / decrease + 1`` is sampled below ``b*``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

SIGNAL = "mismatch/log_rho_p{quantile:g}"


@dataclass
class BudgetStep:
    """One decision: the budget a batch was sampled at, what it measured, and the next budget."""
    sampled_at: int
    log_rho_quantile: float
    violated: bool
    budget: int  # the budget from now on


class BudgetController:
    """The budget in force and its law. ``low``/``high``: the bounds; ``start``: the first budget;
    ``quantile`` (percent) and ``min_rho``: the target; ``increase``/``decrease``: the steps (tokens)."""

    def __init__(self, low: int, high: int, start: int, quantile: float, min_rho: float,
                 increase: int, decrease: int) -> None:
        if not (0 < low <= start <= high):
            raise ValueError(f"expected 0 < min <= start <= max, got {low}, {start}, {high}")
        if increase < 1 or decrease < 1:
            raise ValueError(f"increase and decrease must be >= 1 token, got {increase}, {decrease}")
        if not 0 < min_rho < 1:
            raise ValueError(f"min_rho must be in (0, 1), got {min_rho}")
        self.low, self.high, self.quantile, self.min_rho = low, high, quantile, min_rho
        self.increase, self.decrease = increase, decrease
        self.budget = start

    @classmethod
    def from_config(cls, kv: Any) -> Optional[BudgetController]:
        """The controller of a ``KVCompressionConfig`` (None: a fixed budget, or no compression)."""
        auto = kv.auto_budget
        if auto is None or kv.policy == "none":
            return None
        return cls(auto.min, auto.max, kv.budget, auto.quantile, auto.min_rho, auto.step_up, auto.step_down)

    @property
    def signal(self) -> str:
        """The metric the law reads."""
        return SIGNAL.format(quantile=self.quantile)

    def update(self, metrics: dict[str, float], sampled_at: int) -> BudgetStep:
        """The next budget after a batch sampled at budget ``sampled_at`` measured ``metrics`` (its
        iteration's merged step metrics)."""
        value = float(metrics.get(self.signal, float("nan")))
        violated = not math.isnan(value) and value < math.log(self.min_rho)
        if math.isnan(value):
            pass
        elif violated:
            self.budget = min(self.high, max(self.budget, sampled_at + self.increase))
        else:
            self.budget = max(self.low, self.budget - self.decrease)
        return BudgetStep(sampled_at, value, violated, self.budget)

    def state(self) -> dict[str, int]:
        return {"budget": self.budget}

    def load_state(self, state: dict[str, Any]) -> int:
        """Continue from a checkpoint's state; returns the saved budget (the one in force is it, clamped
        to the bounds when they changed since)."""
        saved = int(state["budget"])
        self.budget = min(self.high, max(self.low, saved))
        return saved
