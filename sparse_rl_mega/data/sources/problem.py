"""What a data source yields: a problem with its gold label (and worked answer, when generated), and
the errors of preparing data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
