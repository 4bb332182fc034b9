"""Shims that let Megatron-Core run its real TP/PP/DP code on CPU with gloo.

Applied only when CUDA is unavailable (:func:`apply_if_cpu`), before Megatron is imported. Each shim
answers a concrete failure of megatron-core 0.16 on a CPU-only torch build:

* ``torch.cuda.current_device()`` returns the CPU device: buffers are allocated with it, also inside
  autograd backward functions where a TorchFunctionMode is not active;
* ``torch.cuda.synchronize`` / ``empty_cache`` are no-ops (pipeline p2p calls synchronize);
* a TorchFunctionMode maps ``device="cuda"`` to CPU and makes ``.cuda()``/``.pin_memory()`` no-ops
  (hard-coded ``device="cuda"`` in schedules, optimizer and masks), and reports ``torch.cuda.*``
  tensor types (grad clipping and optimizers assert on them);
* a CPU RNG tracker replaces ``model_parallel_cuda_manual_seed`` (it reads CUDA RNG state), and the
  CUDA RNG state that activation recomputation saves and restores is an empty placeholder (and the
  recomputed attention's causal mask is built on the CPU).
"""
from __future__ import annotations

import contextlib

import torch

_CPU = torch.device("cpu")
_applied = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaAsCpuMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


def apply_if_cpu() -> bool:
    """Install the shims when CUDA is unavailable. Returns True when they are (or were) installed."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    CudaAsCpuMode().__enter__()  # process-wide, never exited
    _applied = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """Megatron's model-parallel RNG tracker, with CPU generator states when there is no GPU."""
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed)
        return

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed_value):
            self._is_initialized = True
            if seed_value in self.seeds_ or name in self.states_:
                raise RuntimeError(f"RNG state {name} / seed {seed_value} already exists")
            self.seeds_.add(seed_value)
            self.states_[name] = torch.Generator().manual_seed(seed_value).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    # activation recomputation saves and restores "the CUDA RNG state" around each checkpointed part;
    # on CPU all randomness is the CPU generator, which Megatron saves beside it anyway
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    # recomputed attention builds its causal mask with a hard-coded device="cuda" inside the backward
    # pass, where the TorchFunctionMode above is not active
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.model_parallel_cuda_manual_seed(seed)
