"""The GPU stack this project was written and read against, and a check of what is installed.

SGLang 0.5.23 requires torch 2.14.1, CUDA-13 wheels and cuda-python >= 13, its kernels as
``sglang-kernel`` 0.4.10 and flashinfer 0.7.2 (its METADATA). Megatron-Core 0.16.1 was tested with
Transformer Engine >= 2.9, < 2.12 (its ``dev`` extra) and imports ``transformer_engine.pytorch.fp8``;
a Transformer Engine without that module is silently marked absent (``HAVE_TE = False``), after which
the TE layer spec fails on a missing provider, far from the cause. ``setup.py``'s ``gpu`` extra pins
the same; :func:`version_problems` names a mismatch in one line before anything starts.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Optional
from collections.abc import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# distribution -> the versions a GPU run needs (megatron-core and sglang: on the CPU too)
GPU_STACK = {"torch": "==2.14.1", "megatron-core": "==0.16.1", "sglang": "==0.5.23", "sglang-kernel": "==0.4.10",
             "flashinfer-python": "==0.7.2", "cuda-python": ">=13"}
TRANSFORMER_ENGINE = ("transformer-engine", ">=2.9.0a0,<2.12")
CPU_STACK = ("megatron-core", "sglang")


def installed_version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # (a parent package missing)
        return False


def version_problems(on_gpu: bool, transformer_engine: bool,
                     version: Callable[[str], Optional[str]] = installed_version,
                     has_module: Callable[[str], bool] = _has_module) -> list[str]:
    """One line per installed package that differs from what this project was written for (a GPU run:
    :data:`GPU_STACK`, and Transformer Engine when ``transformer_engine`` layers are asked for; on the
    CPU, which can only dry-run or plan those, megatron-core and sglang). ``version(distribution)`` / ``has_module(name)``: what is installed."""
    wanted = dict(GPU_STACK) if on_gpu else {name: GPU_STACK[name] for name in CPU_STACK}
    transformer_engine = transformer_engine and on_gpu  # (a CPU can only dry-run or plan such a run)
    if transformer_engine:
        wanted[TRANSFORMER_ENGINE[0]] = TRANSFORMER_ENGINE[1]
    problems = []
    for name, spec in wanted.items():
        found = version(name)
        if found is None:
            problems.append(f"{name} is not installed; this project needs {name}{spec} (pip install -e .[gpu])")
        elif Version(Version(found).base_version) not in SpecifierSet(spec, prereleases=True):
            problems.append(f"{name} {found} is installed; this project was written for {name}{spec}")
    if transformer_engine and version(TRANSFORMER_ENGINE[0]) and not has_module("transformer_engine.pytorch.fp8"):
        problems.append("transformer_engine.pytorch.fp8 is missing from the installed Transformer Engine: "
                        "Megatron-Core 0.16.1 would then take Transformer Engine as absent (model.transformer_impl)")
    return problems
