"""SnapKV, as the paper's release and R-KV's repository compute it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Optional

from sparse_rl_mega.kv.base import GQA_POOLS, POOLS, EvictionPolicy, PolicyError

if TYPE_CHECKING:  # (annotations only)
    import torch


@dataclass
class SnapKVPolicy(EvictionPolicy):
    """SnapKV as the paper's release and R-KV's repository compute it: :func:`window_importance` (logits
    pooled over the GQA group with ``gqa_pool``, softmax over the keys before the window, mean over the
    window's queries, ``pool`` over ``kernel`` neighbours). Original SnapKV pools with ``avg``."""
    kernel: int = field(default=7, metadata={"help": "pooling kernel along the sequence (odd)"})
    pool: str = field(default="max", metadata={"help": "pooling mode (release: max; original SnapKV: avg)",
                                               "choices": POOLS})
    gqa_pool: str = field(default="max", metadata={"help": "over a KV head's query heads, on the logits",
                                                   "choices": GQA_POOLS})
    queries_needed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise PolicyError("params.kernel", f"{name}: kernel must be odd and >= 1, got {self.kernel}")
        for key, allowed in (("pool", POOLS), ("gqa_pool", GQA_POOLS)):
            if getattr(self, key) not in allowed:
                raise PolicyError(f"params.{key}", f"{name}: {key} must be one of {', '.join(allowed)}, "
                                                   f"got {getattr(self, key)!r}")

    def score(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor],
              accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        from sparse_rl_mega.kv import scoring  # (torch: imported when a policy scores, see base.py)

        if window_queries is None:
            raise ValueError("SnapKV scores with the window's queries [q_heads, window, head_dim]")
        return scoring.window_importance(keys, window_queries, self.gqa_pool, self.kernel, self.pool)
