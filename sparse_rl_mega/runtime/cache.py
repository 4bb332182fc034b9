"""The per-user cache of things that are slow to make and depend only on package versions (an empty
MLflow store, the dequantized SmolLM2 folder): ``$XDG_CACHE_HOME/sparse_rl_mega`` or
``~/.cache/sparse_rl_mega``. Entries are named by the versions that produced them and written under a
temporary name, then renamed, so concurrent users never see half an entry."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparse_rl_mega"
