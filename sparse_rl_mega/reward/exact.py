"""Exact-answer reward: the last number in the response (or its ``\\boxed{}``) equals the label.

Model output is only matched with a bounded regular expression and parsed with ``float``; it is
never evaluated.
"""
from __future__ import annotations

import re
from typing import Optional

_BOXED = re.compile(r"\\boxed\{([^{}]{0,64})\}")
_NUMBER = re.compile(r"-?\d[\d,]{0,30}(?:\.\d{1,30})?")
_MAX_CHARS = 20_000  # only the tail of a runaway response is inspected


def extract_final_number(response: str) -> Optional[float]:
    """The value of the last ``\\boxed{}`` number, else of the last number; None when there is none."""
    tail = response[-_MAX_CHARS:]
    boxed = _BOXED.findall(tail)
    candidates = _NUMBER.findall(boxed[-1]) if boxed else []
    if not candidates:
        candidates = _NUMBER.findall(tail)
    if not candidates:
        return None
    try:
        return float(candidates[-1].replace(",", ""))
    except ValueError:
        return None


def exact_answer_reward(response: str, label: str) -> float:
    """1.0 when the response's final number equals ``label`` (numerically), else 0.0."""
    predicted = extract_final_number(response)
    expected = extract_final_number(label)
    if predicted is None or expected is None:
        return 0.0
    return 1.0 if abs(predicted - expected) <= 1e-9 * max(1.0, abs(expected)) else 0.0
