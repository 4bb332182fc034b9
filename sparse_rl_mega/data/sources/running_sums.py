"""The long-response task of running sums: twelve operands summed one step at a time, then two early
sums added, each problem with its worked answer."""
from __future__ import annotations

import random

from sparse_rl_mega.data.sources.problem import Problem

LONG_SUMS_OPERANDS = 12
LONG_SUMS_TEST_SIZE = 128


def long_sum_problem(operands: list[int], first: int, second: int, index: str) -> Problem:
    """The long-response task: running sums of ``operands`` written one step a line, then the sum of
    two of those partial results (``s<first> + s<second>``, 1-based), which the answer must look up
    where it wrote them, early in its own response. Raw prompt ``Q: 3 5 7 ... s4 + s9 A:``; worked
    answer `` s1 = 3 ; s2 = 3 + 5 = 8 ; ... s4 + s9 = 17 + 40 = 57 . The answer is 57 .``"""
    partial, steps = [operands[0]], [f" s1 = {operands[0]} ;"]
    for k, value in enumerate(operands[1:], start=2):
        steps.append(f" s{k} = {partial[-1]} + {value} = {partial[-1] + value} ;")
        partial.append(partial[-1] + value)
    a, b = partial[first - 1], partial[second - 1]
    worked = "".join(steps) + f" s{first} + s{second} = {a} + {b} = {a + b} . The answer is {a + b} ."
    question = f"Q: {' '.join(map(str, operands))} s{first} + s{second} A:"
    return Problem(question, str(a + b), index, True, worked=worked, raw=True)


def long_sums(split: str, seed: int, count: int) -> list[Problem]:
    """``LONG_SUMS_OPERANDS`` digits 1-9 and two distinct steps 2..n to recall, drawn by ``seed``:
    ``test`` the first ``LONG_SUMS_TEST_SIZE`` distinct problems, ``train`` the next ``count``
    (disjoint for the same seed). Responses ~140 tokens with the task's own tokenizer, prompts <= 21."""
    rng = random.Random(seed)
    seen: dict[str, Problem] = {}
    while len(seen) < LONG_SUMS_TEST_SIZE + count:
        operands = [rng.randint(1, 9) for _ in range(LONG_SUMS_OPERANDS)]
        first, second = sorted(rng.sample(range(2, LONG_SUMS_OPERANDS + 1), 2))
        problem = long_sum_problem(operands, first, second, f"long_sums/{len(seen)}")
        seen.setdefault(problem.question, problem)
    problems = list(seen.values())
    return problems[:LONG_SUMS_TEST_SIZE] if split == "test" else problems[LONG_SUMS_TEST_SIZE:]


