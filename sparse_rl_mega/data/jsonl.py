"""Prompt datasets from jsonl files: one JSON object per line, read by a row format:

* ``prompt_label`` (default, :class:`PromptLabelFormat`): ``{"prompt": ..., "label": ...}``, the prompt
  used exactly as written (e.g. already chat-templated by ``tools/prepare_data.py``);
* ``question_answer`` (:class:`QuestionAnswerFormat`): raw ``{"question": ..., "answer": ...}`` rows
  formatted at load time (instruction appended, optional chat template; the gold answer taken after
  ``####`` or from the last ``\\boxed{}``, see :mod:`sparse_rl_mega.data.formatting`).

Bad rows are never dropped silently: loading fails with every bad row listed (file, line, reason).
Iteration order is a deterministic function of the seed and the position, so a run that resumes at
iteration k sees the same prompts as an uninterrupted one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from collections.abc import Callable, Iterator

from sparse_rl_mega.data.formatting import DEFAULT_INSTRUCTION, extract_gold, load_chat_tokenizer, render_prompt


class DataError(ValueError):
    """A data file problem; the message names the file and line(s)."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    label: str
    source: str  # "file:line", for error reports and debugging


class RowError(ValueError):
    """One row cannot be used; the dataset reports it with its file and line."""


def _label_text(value: Any) -> Optional[str]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value if isinstance(value, str) and value.strip() else None


class PromptLabelFormat:
    """``{prompt_key: str, label_key: str | number}`` rows; the prompt is used as written."""

    def __init__(self, prompt_key: str = "prompt", label_key: str = "label", from_config: bool = False):
        """``from_config``: the keys are the run config's ``data.prompt_key`` / ``data.label_key`` (a
        missing key's message names them)."""
        self.prompt_key, self.label_key, self.from_config = prompt_key, label_key, from_config

    def __call__(self, row: dict) -> tuple[str, str]:
        for key, setting in ((self.prompt_key, "data.prompt_key"), (self.label_key, "data.label_key")):
            if key not in row:
                hint = "" if not self.from_config else f": {setting} names the row's key for it" + (
                    "; raw question/answer rows: data.format: question_answer" if "question" in row else "")
                raise RowError(f"key {key!r} is missing (the row has {', '.join(map(repr, row)) or 'no key'}){hint}")
        prompt = row.get(self.prompt_key)
        if not isinstance(prompt, str) or not prompt.strip():
            raise RowError(f"key {self.prompt_key!r} must be a string that is not blank, got {prompt!r}")
        label = _label_text(row.get(self.label_key))
        if label is None:
            raise RowError(f"key {self.label_key!r} must be a number or a string that is not blank, "
                           f"got {row.get(self.label_key)!r}")
        return prompt, label


class QuestionAnswerFormat:
    """Raw ``{question_key: str, answer_key: str | number}`` rows, formatted at load time.

    prompt = ``question + "\\n" + instruction``, rendered with ``tokenizer``'s chat template when one
    is given; label = the gold answer extracted from the answer (:func:`extract_gold`: after ``####``,
    else the last ``\\boxed{}``, else the whole answer)."""

    def __init__(self, question_key: str = "question", answer_key: str = "answer",
                 instruction: str = DEFAULT_INSTRUCTION, tokenizer=None):
        self.question_key, self.answer_key = question_key, answer_key
        self.instruction, self.tokenizer = instruction, tokenizer

    def __call__(self, row: dict) -> tuple[str, str]:
        if self.question_key not in row:
            raise RowError(f"key {self.question_key!r} is missing (keys: {', '.join(map(repr, row)) or 'none'})")
        question = row[self.question_key]
        if not isinstance(question, str) or not question.strip():
            raise RowError(f"key {self.question_key!r} must be a non-empty string, got {question!r}")
        if self.answer_key not in row:
            raise RowError(f"key {self.answer_key!r} is missing (keys: {', '.join(map(repr, row)) or 'none'})")
        label = extract_gold(row[self.answer_key])
        if label is None:
            raise RowError(f"key {self.answer_key!r} holds no gold answer (empty after '####', an unclosed "
                           f"\\boxed{{}}, or not a string/number): {str(row[self.answer_key])[-80:]!r}")
        return render_prompt(question, self.instruction, self.tokenizer), label


RowFormat = Callable[[dict], tuple[str, str]]


def json_objects(path: str | Path) -> Iterator[tuple[str, int, Optional[dict], Optional[str]]]:
    """``(where, line_no, row, problem)`` for every non-blank line of a jsonl file: ``row`` is the
    line's JSON object, or None with ``problem`` saying why (``where`` is ``file:line``)."""
    with Path(path).open("rb") as handle:  # (bytes: a line that is not UTF-8 is reported with its number)
        for line_no, raw in enumerate(handle, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, line_no, None, f"not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line)"
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, line_no, None, f"not valid JSON ({exc.msg})"
                continue
            if not isinstance(row, dict):
                yield where, line_no, None, f"expected a JSON object, got {type(row).__name__}"
                continue
            yield where, line_no, row, None


class PromptDataset:
    def __init__(self, path: str | Path, prompt_key: str = "prompt", label_key: str = "label",
                 max_errors_shown: int = 10, row_format: Optional[RowFormat] = None):
        """``row_format`` turns a row into ``(prompt, label)`` or raises :class:`RowError`; default:
        ``PromptLabelFormat(prompt_key, label_key)``."""
        row_format = row_format or PromptLabelFormat(prompt_key, label_key)
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: data file not found")
        self.records: list[PromptRecord] = []
        errors: list[str] = []
        for where, _, row, problem in json_objects(self.path):
            if problem is None:
                try:
                    prompt, label = row_format(row)
                except RowError as exc:
                    problem = str(exc)
            if problem is not None:
                errors.append(f"{where}: {problem}")
                continue
            self.records.append(PromptRecord(prompt, label, where))
        if errors:
            shown = "\n  ".join(errors[:max_errors_shown])
            more = f"\n  ... and {len(errors) - max_errors_shown} more" if len(errors) > max_errors_shown else ""
            raise DataError(f"{self.path}: {len(errors)} bad row(s):\n  {shown}{more}")
        if not self.records:
            raise DataError(f"{self.path}: no rows")

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, iteration: int, size: int, seed: int, shuffle: bool = True) -> list[PromptRecord]:
        """Prompts of ``iteration``: consecutive slices of per-epoch permutations (seeded by epoch)."""
        import torch  # (here: the tools that only read data files start without it)

        out = []
        start = iteration * size
        for position in range(start, start + size):
            epoch, offset = divmod(position, len(self.records))
            if shuffle:
                order = torch.randperm(len(self.records), generator=torch.Generator().manual_seed(seed + epoch))
                offset = int(order[offset])
            out.append(self.records[offset])
        return out


def load_prompt_dataset(data_cfg, default_tokenizer: Optional[str | Path] = None) -> PromptDataset:
    """The training dataset a :class:`~sparse_rl_mega.config.DataConfig` describes.

    ``question_answer`` rows with ``apply_chat_template`` use the tokenizer at ``data_cfg.tokenizer``,
    else at ``default_tokenizer`` (the trainer passes ``model.path``); loaded here so that every rank
    can build the dataset before the model exists on it."""
    if data_cfg.format == "prompt_label":
        return PromptDataset(data_cfg.train_path, row_format=PromptLabelFormat(data_cfg.prompt_key, data_cfg.label_key,
                                                                              from_config=True))
    tokenizer = None
    if data_cfg.apply_chat_template:
        path = data_cfg.tokenizer or default_tokenizer
        if not path:
            raise DataError("data.tokenizer: data.apply_chat_template needs a tokenizer folder (default: model.path)")
        try:
            tokenizer = load_chat_tokenizer(path)
        except (OSError, ValueError) as exc:
            raise DataError(f"data.tokenizer: {exc}") from exc
    row_format = QuestionAnswerFormat(data_cfg.question_key, data_cfg.answer_key, data_cfg.instruction, tokenizer)
    return PromptDataset(data_cfg.train_path, row_format=row_format)
