"""R-KV: importance minus redundancy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from sparse_rl_mega.kv.base import PolicyError
from sparse_rl_mega.kv.snapkv import SnapKVPolicy

if TYPE_CHECKING:  # (annotations only)
    import torch


@dataclass
class RKVPolicy(SnapKVPolicy):
    """R-KV: ``lam * importance - (1 - lam) * redundancy`` over the keys before the window: importance as
    :class:`SnapKVPolicy` (max-pooled), redundancy :func:`key_redundancy` of all keys (the window's
    included), sliced to the keys before the window. ``lam`` 0.1 as in the paper's runs (R-KV's own
    default is 0.07)."""
    lam: float = field(default=0.1, metadata={"help": "importance weight (1 - lam weighs redundancy; R-KV's own "
                                                      "default 0.07)"})
    similarity_threshold: float = field(default=0.5, metadata={"help": "cosine similarity above which keys are "
                                                                       "near-duplicates"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.lam <= 1.0:
            raise PolicyError("params.lam", f"R-KV: need 0 <= lam <= 1, got {self.lam}")

    @classmethod
    def scoring_bytes(cls, *, scored_layers: int, kv_heads: int, length: int) -> int:
        # the key similarities: float32 and two one-byte masks per key pair and head of every scored layer
        return scored_layers * kv_heads * length * length * 6

    def score(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor],
              accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        from sparse_rl_mega.kv import scoring  # (torch: imported when a policy scores, see base.py)

        if window_queries is None:
            raise ValueError("R-KV scores with the window's queries [q_heads, window, head_dim]")
        older = keys.shape[1] - window_queries.shape[1]
        importance = scoring.window_importance(keys, window_queries, self.gqa_pool, self.kernel, self.pool)
        redundancy = scoring.key_redundancy(keys, self.similarity_threshold)[:, :older]
        return self.lam * importance - (1.0 - self.lam) * redundancy
