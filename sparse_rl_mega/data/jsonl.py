"""Prompt datasets from jsonl files: one ``{"prompt": ..., "label": ...}`` object per line.

Bad rows are never dropped silently: loading fails with every bad row listed (file, line, reason).
Iteration order is a deterministic function of the seed and the position, so a run that resumes at
iteration k sees the same prompts as an uninterrupted one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


class DataError(ValueError):
    """A data file problem; the message names the file and line(s)."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    label: str
    source: str  # "file:line", for error reports and debugging


class PromptDataset:
    def __init__(self, path: str | Path, prompt_key: str = "prompt", label_key: str = "label",
                 max_errors_shown: int = 10):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"{self.path}: data file not found")
        self.records: list[PromptRecord] = []
        errors: list[str] = []
        with self.path.open() as handle:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{line_no}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    errors.append(f"{where}: not valid JSON ({exc.msg})")
                    continue
                if not isinstance(row, dict):
                    errors.append(f"{where}: expected a JSON object, got {type(row).__name__}")
                    continue
                prompt, label = row.get(prompt_key), row.get(label_key)
                if not isinstance(prompt, str) or not prompt:
                    errors.append(f"{where}: key {prompt_key!r} must be a non-empty string, got {prompt!r}")
                    continue
                if isinstance(label, (int, float)) and not isinstance(label, bool):
                    label = str(label)
                if not isinstance(label, str) or not label:
                    errors.append(f"{where}: key {label_key!r} must be a non-empty string or number, got {label!r}")
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
        out = []
        start = iteration * size
        for position in range(start, start + size):
            epoch, offset = divmod(position, len(self.records))
            if shuffle:
                order = torch.randperm(len(self.records), generator=torch.Generator().manual_seed(seed + epoch))
                offset = int(order[offset])
            out.append(self.records[offset])
        return out
