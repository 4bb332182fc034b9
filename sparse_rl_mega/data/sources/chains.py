"""The digit-chain tasks (examples/cpu_long_chain.yaml, examples/cpu_long_tail.yaml): a chain of digits
where each line needs only the line before it, then one early digit recalled; the tail task mixes
short and long chains."""
from __future__ import annotations

import random

from sparse_rl_mega.data.sources.problem import PrepareError, Problem

CHAIN_STEPS = 12
CHAIN_TEST_SIZE = 128
TAIL_SHORT_STEPS, TAIL_LONG_EVERY = 3, 8  # tail task: 3-step chains, and a 12-step one in every 8 problems


def chain_problem(first: int, second: int, key: int, recall: int, index: str, steps: int = CHAIN_STEPS,
                  tail: bool = False) -> Problem:
    """The long-response task built so that its steps survive eviction and its last step does not
    (measured: true at 128 slots; at 32-64 the chain itself breaks, a wrong key taken although the
    prompt holding it is kept; docs/results.md). The digits
    ``s1 = first``, ``s2 = second``, ``s<k> = (s<k-2> + s<k-1> + key) mod 10`` written one line a step,
    each as two additions of two numbers and the last digit (``s3 = 3 + 7 = 10 + 4 = 14 , 4 ;``: a
    0.9 M-parameter model did not learn the three-digit sum mod 10 in one step, 7 % of chains right
    greedy after 1500 warm-up steps); every line restates what the next one needs (its second operand
    and its digit), so a cache that keeps the recent lines keeps the chain going. Then
    ``s<recall> + s<CHAIN_STEPS>``, which must look up a line written up to ~150 tokens earlier. Raw
    prompt ``Q: 3 7 4 s5 A:``; worked answer `` s1 = 3 ; s2 = 7 ; s3 = 3 + 7 = 10 + 4 = 14 , 4 ; ...
    s5 + s12 = 9 + 1 = 10 . The answer is 10 .``. ``tail``: a chain of ``steps`` digits, its length in the
    prompt (``Q: 3 7 4 s2 n3 A:``)."""
    digits, lines = [first, second], [f" s1 = {first} ;", f" s2 = {second} ;"]
    for k in range(3, steps + 1):
        digits.append((digits[-2] + digits[-1] + key) % 10)
        pair = digits[-3] + digits[-2]
        lines.append(f" s{k} = {digits[-3]} + {digits[-2]} = {pair} + {key} = {pair + key} , {digits[-1]} ;")
    a, b = digits[recall - 1], digits[-1]
    worked = "".join(lines) + f" s{recall} + s{steps} = {a} + {b} = {a + b} . The answer is {a + b} ."
    length = f" n{steps}" if tail else ""
    return Problem(f"Q: {first} {second} {key} s{recall}{length} A:", str(a + b), index, True, worked=worked, raw=True)


def _split_chains(seed: int) -> tuple[random.Random, list, list]:
    """The 900 chains (seeds 0-9, 0-9, key 1-9) shuffled by ``seed``: (the generator, which draws on,
    the first ``CHAIN_TEST_SIZE`` held out, the rest)."""
    rng = random.Random(seed)
    chains = [(x, y, key) for x in range(10) for y in range(10) for key in range(1, 10)]
    rng.shuffle(chains)
    return rng, chains[:CHAIN_TEST_SIZE], chains[CHAIN_TEST_SIZE:]


def digit_chains(split: str, seed: int, count: int) -> list[Problem]:
    """Chains from seeds 0-9, 0-9 and a key 1-9 (900), shuffled by ``seed``: ``test`` one problem each
    for the first ``CHAIN_TEST_SIZE`` chains (the recalled step drawn from 1..CHAIN_STEPS-1), ``train``
    ``count`` distinct (chain, recalled step) problems from the other chains only, so held-out accuracy
    measures the computation, not a memorised chain."""
    rng, held_out, rest = _split_chains(seed)
    if split == "test":
        return [chain_problem(*chain, rng.randint(1, CHAIN_STEPS - 1), f"chain/test/{i}")
                for i, chain in enumerate(held_out)]
    available = len(rest) * (CHAIN_STEPS - 1)
    if count > available:
        raise PrepareError(f"--arith-count {count}: chain_train has only {available} distinct problems")
    picks = rng.sample(range(available), count)
    return [chain_problem(*rest[p // (CHAIN_STEPS - 1)], p % (CHAIN_STEPS - 1) + 1, f"chain/train/{i}")
            for i, p in enumerate(picks)]


def tail_chains(split: str, seed: int, count: int) -> list[Problem]:
    """Long-tailed response lengths: the chain task with its length in the prompt, every
    ``TAIL_LONG_EVERY``-th problem a chain of ``CHAIN_STEPS`` digits and the others of
    ``TAIL_SHORT_STEPS``, each (chain, length, recalled step) once; chains split as
    :func:`digit_chains` splits them (``test``: ``CHAIN_TEST_SIZE`` problems from the held-out chains)."""
    rng, held_out, rest = _split_chains(seed)
    pool = held_out if split == "test" else rest
    count = CHAIN_TEST_SIZE if split == "test" else count
    available = len(pool) * (TAIL_SHORT_STEPS - 1)  # (the short problems run out first)
    if count > available * TAIL_LONG_EVERY // (TAIL_LONG_EVERY - 1):
        raise PrepareError(f"--arith-count {count}: tail_train has only ~{available} distinct short problems")
    problems, seen = [], set()
    while len(problems) < count:
        steps = CHAIN_STEPS if len(problems) % TAIL_LONG_EVERY == 0 else TAIL_SHORT_STEPS
        chain, recall = pool[rng.randrange(len(pool))], rng.randint(1, steps - 1)
        if (chain, steps, recall) not in seen:
            seen.add((chain, steps, recall))
            problems.append(chain_problem(*chain, recall, f"tail/{split}/{len(problems)}", steps, tail=True))
    return problems


