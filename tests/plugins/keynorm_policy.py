"""A KV policy outside ``sparse_rl_mega/kv/``, as a user's package would add one (the tests' plugin).

It keeps the keys of largest norm. Registered through the ``sparse_rl_mega.kv_policies`` entry point of
the distribution beside it (``sparse_rl_mega_keynorm-0.1.dist-info``); ``tests/conftest.py`` puts this
folder on ``PYTHONPATH``, so every process of the test session (SGLang's schedulers included) finds it.
"""
from dataclasses import dataclass, field

from sparse_rl_mega.kv import EvictionPolicy, PolicyError


@dataclass
class KeyNormPolicy(EvictionPolicy):
    """Scores each older key by its ``power``-norm, summed as the selection says."""
    power: int = field(default=2, metadata={"help": "the norm's order"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.power < 1:
            raise PolicyError("params.power", f"keynorm: power must be >= 1, got {self.power}")

    def score(self, keys, window_queries, accumulated=None):
        return keys.float().norm(p=self.power, dim=-1)[:, :keys.shape[1] - self.window]
