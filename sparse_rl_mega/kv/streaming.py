"""StreamingLLM: attention sinks and the most recent tokens, chosen by position."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from sparse_rl_mega.kv.base import EvictionPolicy

if TYPE_CHECKING:  # (annotations only)
    import torch


@dataclass
class StreamingPolicy(EvictionPolicy):
    """StreamingLLM: the first ``sink`` tokens (attention sinks) and the most recent ones; every
    non-sink slot of the budget goes to recent tokens. The same tokens in every layer and head."""
    position_only: ClassVar[bool] = True

    def score(self, keys: torch.Tensor, window_queries: Optional[torch.Tensor],
              accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError("streaming selects by position")

    def select(self, keys: Optional[torch.Tensor], window_queries: Optional[torch.Tensor], budget: int,
               length: Optional[int] = None, accumulated: Optional[torch.Tensor] = None) -> torch.Tensor:
        import torch  # (here, not at the top: the config reads the policies' declarations without torch)

        self.check_budget(budget)
        if length is None:
            if keys is None:
                raise ValueError("streaming selects by position: give the length (or the keys)")
            length = keys.shape[1]
        n = int(length)
        if n <= budget:
            return torch.arange(n)
        return torch.cat([torch.arange(self.sink), torch.arange(n - (budget - self.sink), n)])
