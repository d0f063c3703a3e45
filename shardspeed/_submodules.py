"""Submodules as attributes on first access, as after ``import deepspeed``.

DeepSpeed imports its subpackages eagerly, so ``deepspeed.runtime.lr_schedules`` works
after a bare ``import deepspeed``. ShardSpeed keeps ``import shardspeed`` cheap instead: a
package's module-level ``__getattr__`` calls :func:`load_submodule`, which imports the
submodule the first time its name is read.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def load_submodule(package: str, name: str) -> ModuleType:
    """Import ``package.name`` when it exists; otherwise raise the usual AttributeError."""
    if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
