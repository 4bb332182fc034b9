"""Generated arithmetic sets, each a pure function of its seed: one-step word problems (``easy_arith``),
single-digit sums (the demo's) and teen sums (the harder-compression ablation's)."""
from __future__ import annotations

import random
from collections.abc import Iterator

from sparse_rl_mega.data.sources.problem import Problem

_NAMES = ["Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Lena", "Omar", "Maya",
          "Noah", "Rosa", "Sam"]
_ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "stamps", "shells", "cards", "balloons",
          "coins", "eggs"]


def easy_arith(count: int, seed: int) -> Iterator[Problem]:
    """``count`` distinct one-step word problems, a pure function of ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    while len(seen) < count:
        name, item, op = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice("+-*/")
        if op == "+":
            a, b = rng.randint(2, 50), rng.randint(2, 50)
            question, answer = (f"{name} has {a} {item}. {name} gets {b} more {item}. "
                                f"How many {item} does {name} have now?"), a + b
        elif op == "-":
            a = rng.randint(5, 60)
            b = rng.randint(1, a - 1)
            question, answer = (f"{name} has {a} {item} and gives {b} of them to a friend. "
                                f"How many {item} does {name} have left?"), a - b
        elif op == "*":
            a, b = rng.randint(2, 20), rng.randint(2, 20)
            question, answer = (f"{name} buys {a} bags with {b} {item} in each bag. "
                                f"How many {item} does {name} buy in total?"), a * b
        else:
            per, friends = rng.randint(2, 12), rng.randint(2, 9)
            question, answer = (f"{name} shares {per * friends} {item} equally among {friends} friends. "
                                f"How many {item} does each friend get?"), per
        if question in seen:
            continue
        seen.add(question)
        yield Problem(question, str(answer), f"easy_arith/{len(seen) - 1}", True)



SUMS_TEST_SIZE = 32


def single_digit_sums(split: str, seed: int) -> list[Problem]:
    """"What is a + b?" for a, b in 1..9: the 81 pairs shuffled by ``seed``; the first
    ``SUMS_TEST_SIZE`` form ``test``, the other 49 ``train`` (disjoint for the same seed)."""
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:SUMS_TEST_SIZE] if split == "test" else pairs[SUMS_TEST_SIZE:]
    return [Problem(f"What is {a} + {b}?", str(a + b), f"sums/{a}+{b}", True) for a, b in chosen]


TEEN_SUMS_TEST_SIZE = 128


def teen_sums(split: str, seed: int) -> list[Problem]:
    """"What is a + b?" for a, b in 1..19 where at least one is a single digit (261 pairs, answers
    2-28): shuffled by ``seed``, the first ``TEEN_SUMS_TEST_SIZE`` form ``test``, the other 133
    ``train``. Enough held-out problems to resolve a few points of accuracy, still easy enough for
    SmolLM2-135M to start with some reward."""
    pairs = [(a, b) for a in range(1, 20) for b in range(1, 20) if min(a, b) <= 9]
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:TEEN_SUMS_TEST_SIZE] if split == "test" else pairs[TEEN_SUMS_TEST_SIZE:]
    return [Problem(f"What is {a} + {b}?", str(a + b), f"teen_sums/{a}+{b}", True) for a, b in chosen]


