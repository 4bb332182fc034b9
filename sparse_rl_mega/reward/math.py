"""Math reward: extract the final answer of a response and check it against the label with math-verify.

Extraction (here, in the calling process; linear-time scans over a bounded tail of the text):

* the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces and at most ``MAX_ANSWER_CHARS``
  characters (a truncated or oversized last box falls back to the box before it; a response whose only
  boxes are broken has no answer);
* a response without any box: the configured fallback, ``answer_is`` (the text after the last
  "the answer is" / "Answer:"), ``last_number`` (the last number in the text),
  ``answer_is_or_last_number`` (the phrase, else the last number) or ``none``;
* a label written GSM8K-style, ``... #### 42``, is the text after the last ``####``; a label holding a
  ``\\boxed{}`` (a MATH solution) is its last box; any other label is used as written.

Equivalence: equal normalised strings or equal integers are decided here; everything else goes to
``math_verify.parse`` + ``math_verify.verify`` (sympy) in worker processes with a per-item time limit
(:mod:`sparse_rl_mega.reward.scorer`), because a sympy evaluation of, e.g., ``9^{9^{9^{9}}}`` never
ends and cannot be interrupted from inside (math-verify's own ``signal.alarm`` only works in a main
thread and not inside C code). Model output is only scanned and handed to math-verify's LaTeX / sympy
parsers; it is never evaluated as Python code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

FALLBACKS = ("answer_is_or_last_number", "answer_is", "last_number", "none")
TAIL_CHARS = 32_768        # only the end of a runaway response is inspected
MAX_ANSWER_CHARS = 512     # MATH500's longest answer has 53 characters
MAX_NESTING = 24           # brackets deeper than this are not handed to the parser
_MAX_BOX_TRIES = 4         # boxes tried from the end when the last ones are truncated / oversized

_BOX_START = re.compile(r"\\(?:boxed|fbox)\s{0,8}\{")
_ANSWER_IS = re.compile(r"(?:the\s{1,4}(?:final\s{1,4})?answer\s{1,4}is|answer\s{0,4}:)[ \t:]{0,8}", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\d.])-?\d{1,40}(?:,\d{3}){0,12}(?:\.\d{1,40})?(?:/\d{1,40})?(?!\d)")
_INTEGER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d{1,60})")
_NUMBER_WITH_UNIT = re.compile(r"(-?\d[\d.,/]{0,59})\s+(?!pi\b)[A-Za-z]{2,20}(?:\s+[A-Za-z]{1,20}){0,3}")
_STRIP_FOR_EQUALITY = re.compile(r"\s+|\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$")


@dataclass
class Extracted:
    """The answer taken from a response: its text (None when there is none) and whether it was boxed."""
    answer: Optional[str]
    boxed: bool


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` in the tail of ``text``, or None."""
    tail = text[-TAIL_CHARS:]
    starts = [m.end() for m in _BOX_START.finditer(tail)]
    for start in reversed(starts[-_MAX_BOX_TRIES:]):
        content = _balanced(tail, start)
        if content is not None:
            return content.strip()
    return None


def _balanced(text: str, start: int) -> Optional[str]:
    """The text from ``start`` up to the ``}`` closing the ``{`` just before it; None if not within bounds."""
    depth = 1
    limit = min(len(text), start + MAX_ANSWER_CHARS + 1)
    i = start
    while i < limit:
        ch = text[i]
        if ch == "\\":  # an escaped brace \{ \} does not count
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _answer_is(tail: str) -> Optional[str]:
    matches = list(_ANSWER_IS.finditer(tail))
    if not matches:
        return None
    rest = tail[matches[-1].end():matches[-1].end() + 2 * MAX_ANSWER_CHARS]
    rest = rest.split("\n", 1)[0].strip().strip("*").strip()
    math_span = re.match(rf"\$\$?([^$]{{1,{MAX_ANSWER_CHARS}}})\$", rest) or re.match(
        rf"\\\(([^\n]{{1,{MAX_ANSWER_CHARS}}}?)\\\)", rest)
    if math_span:
        rest = math_span.group(1)
    else:  # up to the end of the sentence
        rest = re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0]
    rest = rest.strip().rstrip(".").strip()
    return rest or None


def _last_number(tail: str) -> Optional[str]:
    numbers = _NUMBER.findall(tail)
    return numbers[-1] if numbers else None


def extract_answer(response: str, fallback: str = "answer_is_or_last_number") -> Extracted:
    """The final answer of a model response (see the module docstring)."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    tail = response[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is not None:
        return Extracted(boxed, True)
    if _BOX_START.search(tail):  # a box that is cut off, oversized or unbalanced: no answer (no fallback)
        return Extracted(None, False)
    answer = None
    if fallback in ("answer_is", "answer_is_or_last_number"):
        answer = _answer_is(tail)
    if answer is None and fallback in ("last_number", "answer_is_or_last_number"):
        answer = _last_number(tail)
    return Extracted(answer, False)


def extract_label(label: str) -> Optional[str]:
    """The gold answer of a label: after the last ``####`` (GSM8K), else its last box, else the label."""
    label = str(label)
    if "####" in label:
        gold = label.rsplit("####", 1)[1].strip()
    else:
        gold = last_boxed(label) if _BOX_START.search(label) else label.strip()
    return gold or None


def normalize(answer: str) -> str:
    """Light clean-up before comparing: ``$``, trailing period, ``\\dfrac``, a digit grouping ``\\,``, units
    after a plain number ("18 dollars" -> "18")."""
    a = answer.strip().strip("$").strip()
    a = a.rstrip(".").strip()
    a = a.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    a = re.sub(r"(?<=\d)\\,(?=\d{3})", "", a)
    a = re.sub(r"^\\\$\s*", "", a)
    m = _NUMBER_WITH_UNIT.fullmatch(a)
    if m:
        a = m.group(1)
    return a


def quick_verdict(pred: str, gold: str) -> Optional[bool]:
    """A verdict without sympy when one is certain: equal normalised strings, or two integers; else None."""
    if _STRIP_FOR_EQUALITY.sub("", pred) == _STRIP_FOR_EQUALITY.sub("", gold):
        return True
    if _INTEGER.fullmatch(pred) and _INTEGER.fullmatch(gold):
        return int(pred.replace(",", "")) == int(gold.replace(",", ""))
    return None


def too_complex(answer: str) -> bool:
    """Longer than MAX_ANSWER_CHARS, unbalanced or nested deeper than MAX_NESTING: not worth parsing."""
    if len(answer) > MAX_ANSWER_CHARS:
        return True
    depth = 0
    for ch in answer:
        if ch in "{([":
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif ch in "})]":
            depth -= 1
    return not braces_balanced(answer)


def braces_balanced(answer: str) -> bool:
    depth = 0
    escaped = False
    for ch in answer:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


# --------------------------------------------------------------------------- run inside a worker only


def verify_answer(pred: str, gold: str, _gold_cache: dict = {}) -> tuple[bool, str]:  # noqa: B006
    """math-verify equivalence of two extracted answers: (correct, status) with status ``ok``,
    ``pred_parse`` or ``label_parse``. Imports math-verify; unbounded time: call it in a worker."""
    from math_verify import parse, verify

    parsed_gold = _gold_cache.get(gold)
    if parsed_gold is None:
        parsed_gold = parse("\\boxed{" + gold + "}", parsing_timeout=None)
        if len(_gold_cache) > 4096:
            _gold_cache.clear()
        _gold_cache[gold] = parsed_gold
    if not parsed_gold:
        return False, "label_parse"
    parsed_pred = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not parsed_pred:
        return False, "pred_parse"
    return bool(verify(parsed_gold, parsed_pred, timeout_seconds=None)), "ok"
