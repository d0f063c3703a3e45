"""Kernels and DeepSpeed-compatible optimizer classes (``shardspeed.ops.adam.FusedAdam`` ...).

Subpackages load lazily on first attribute access, so ``import shardspeed.ops`` stays cheap
and a kernel module added under ``ops/`` is reachable as ``shardspeed.ops.<name>`` without
editing this file.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["adagrad", "adam", "lamb", "lion", "op_builder"]


def __getattr__(name: str) -> ModuleType:
    if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{name}")
    globals()[name] = module
    return module


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
