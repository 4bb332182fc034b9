"""H2O: heavy hitters, by the attention every decode query paid."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from sparse_rl_mega.kv.base import EvictionPolicy

if TYPE_CHECKING:  # (annotations only)
    import torch


@dataclass
class H2OPolicy(EvictionPolicy):
    """H2O (heavy hitters): the attention each key received from every decode query so far (summed
    over the GQA group's query heads), accumulated by the caller and carried across compressions. The
    first compression waits for ``window`` decode steps (the prompt's own attention is not counted)."""
    needs_accumulated: ClassVar[bool] = True

    def score(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor],
              accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        if accumulated is None:
            raise ValueError("H2O needs the accumulated attention [kv_heads, length]")
        scores: torch.Tensor = accumulated[:, :accumulated.shape[1] - self.window]
        return scores
