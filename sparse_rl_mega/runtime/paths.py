"""The checkout the package runs from (``make env`` installs it editable): where ``tools/``, ``runs/`` and
``docs/`` are."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
