"""Run CPU code as if its inputs lived on another device, to find tensors a GPU path makes on the CPU.

On a CPU-only machine every tensor is on one device, so a bare ``torch.tensor(...)`` or
``torch.zeros(...)`` in a path that runs on CUDA goes unseen until ``torch.stack`` / ``torch.cat`` /
indexing meet it on a GPU ("Expected all tensors to be on the same device"). Inside
:class:`OtherDevice`, :func:`on_other_device` tensors report device ``meta`` but hold real CPU data
and compute with it; every op is checked as the CUDA dispatcher checks it:

* a plain CPU tensor may meet them only as a 0-dim operand of a pointwise op (TensorIterator's CPU
  scalar exemption); anywhere else the op raises, naming itself and the CPU tensor's shape;
* a factory given ``device=<their device>`` (``torch.zeros(..., device=x.device)``) makes one of them;
  ``x.new_*``, ``*_like`` and every op on them return them;
* ``.cpu()`` / ``.to("cpu")`` are the explicit transfers and return plain CPU tensors, and ``float()``,
  ``.item()``, ``.tolist()`` read their values (a host sync, as on CUDA).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
_CPU = torch.device("cpu")


class OnOtherDevice(torch.Tensor):
    """A CPU tensor (``elem``) that reports :data:`DEVICE`."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                   device=DEVICE, requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def tolist(self):
        return self.elem.tolist()

    def __repr__(self):
        return f"OnOtherDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def on_other_device(tensor: torch.Tensor) -> OnOtherDevice:
    """``tensor`` (CPU) as an input on the other device (keeps ``requires_grad``)."""
    out = OnOtherDevice(tensor.detach().clone())
    return out.requires_grad_() if tensor.requires_grad else out


def _device_type(device) -> str | None:
    return None if device is None else torch.device(device).type


def _dispatch(func, args, kwargs):
    """One aten op where :class:`OnOtherDevice` tensors or ``device=DEVICE`` may take part."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    on_other = any(isinstance(a, OnOtherDevice) for a in tensors)
    target = _device_type(kwargs.get("device"))
    if target == DEVICE.type:
        kwargs = {**kwargs, "device": _CPU}
    if on_other:
        pointwise = torch.Tag.pointwise in func.tags
        for a in tensors:
            if not isinstance(a, OnOtherDevice) and not (pointwise and a.dim() == 0 and a.device == _CPU):
                raise RuntimeError(f"{func}: a tensor of shape {tuple(a.shape)} on {a.device} meets tensors on "
                                   f"the other device (made without its device?)")
    plain_args, plain_kwargs = tree_map(lambda a: a.elem if isinstance(a, OnOtherDevice) else a, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
    if target == _CPU.type or not (on_other or target == DEVICE.type):
        return out  # an explicit transfer to the CPU, or CPU work unrelated to the other device
    return tree_map(lambda a: OnOtherDevice(a) if isinstance(a, torch.Tensor) else a, out)


class _Constructors(torch.overrides.TorchFunctionMode):
    """``torch.tensor`` / ``as_tensor`` / ``Tensor.new_tensor`` build their tensor below the dispatcher's
    modes: here they build it on the CPU and wrap it when asked for the other device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.new_tensor and isinstance(args[0], OnOtherDevice) and \
                _device_type(kwargs.get("device")) in (None, DEVICE.type):
            return OnOtherDevice(args[0].elem.new_tensor(*args[1:], **{**kwargs, "device": _CPU}))
        if func in (torch.tensor, torch.as_tensor) and _device_type(kwargs.get("device")) == DEVICE.type:
            return OnOtherDevice(func(*args, **{**kwargs, "device": _CPU}))
        return func(*args, **kwargs)


class OtherDevice(TorchDispatchMode):
    """The mode under which factories may make :class:`OnOtherDevice` tensors (see the module doc)."""

    def __enter__(self):
        self._constructors = _Constructors()
        self._constructors.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._constructors.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def assert_on_other_device(tree, where: str = "") -> None:
    """Every tensor in ``tree`` (nested dicts, lists, tuples) is on the other device."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            assert isinstance(leaf, OnOtherDevice), f"{where}: a {tuple(leaf.shape)} tensor came back on {leaf.device}"
