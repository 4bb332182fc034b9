"""The optimizer's state allocated before its first step, so that a colocated GPU engine started after
the learner is sized from the memory training really leaves.

torch's and Transformer Engine's Adam allocate ``exp_avg`` / ``exp_avg_sq`` (8 bytes per parameter of
this rank's share, fp32) lazily at the first step. A fresh run starts its colocated engine right after
the HF load, sized from the free memory of that moment; the first step's moments would then meet an
engine that took that memory (and a resumed run, whose state is loaded, sizes differently). The planner
(``cli/planner.py``) counts Adam as resident when the engine starts: this makes it so.
"""
from __future__ import annotations

import torch


def allocate_optimizer_state(optimizer) -> int:
    """Allocate the moments of every parameter that has no optimizer state yet with Megatron's own
    ``init_state_fn`` (what it runs before loading a checkpoint's state), plus torch Adam's ``step``
    where the inner optimizer keeps it per parameter, so the first step computes exactly what it would
    have; then the GPU gets back the allocator's cached free blocks (the engine is sized next).
    ``optimizer``: a Megatron optimizer or ``ChainedOptimizer``. Returns the bytes allocated."""
    allocated = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init_state = getattr(part, "optimizer", None), getattr(part, "init_state_fn", None)
        if inner is None or init_state is None:
            continue
        empty = [p for group in inner.param_groups for p in group["params"] if len(inner.state[p]) == 0]
        init_state(inner, part.config)
        for p in empty:
            state = inner.state[p]
            if isinstance(inner, torch.optim.Optimizer) and "step" not in state and not _steps_per_group(inner):
                state["step"] = torch.zeros((), dtype=torch.float32)  # (torch Adam's own initial step)
            allocated += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return allocated


def _steps_per_group(inner) -> bool:
    """Transformer Engine's and apex's FusedAdam count steps per parameter group, not per parameter."""
    return type(inner).__module__.split(".")[0] in ("transformer_engine", "apex")
