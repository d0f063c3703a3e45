"""Submodules as attributes on first access, as after ``import deepspeed``, and DeepSpeed's
module paths whose code lives in another layer of shardspeed.

DeepSpeed imports its subpackages eagerly, so ``deepspeed.runtime.lr_schedules`` works
after a bare ``import deepspeed``. ShardSpeed keeps ``import shardspeed`` cheap instead: a
package's module-level ``__getattr__`` calls :func:`load_submodule`, which imports the
submodule the first time its name is read.

A few DeepSpeed paths name a module that, in shardspeed's layering, belongs to a higher
layer: ``deepspeed.utils.groups`` needs the job's topology (``runtime/``) and
``deepspeed.utils.zero_to_fp32`` is checkpoint consolidation (``checkpoint/``), while
``utils/`` sits below both. :data:`MOVED_MODULES` maps such a path to the module that
defines it, and an import finder serves the path as that very module (one object, so
monkeypatches and ``isinstance`` checks agree; ``python -m PATH`` runs it too). Nothing in
shardspeed imports these paths (``tests/unit/test_import_layers.py`` checks it): they are
for user code, and through the ``deepspeed`` compatibility package, DeepSpeed's.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType
from typing import Any

# DeepSpeed's path (as a shardspeed module name) -> the shardspeed module that defines it.
MOVED_MODULES: dict[str, str] = {
    "shardspeed.utils.groups": "shardspeed.runtime.groups",
    "shardspeed.utils.zero_to_fp32": "shardspeed.checkpoint.zero_to_fp32",
}


def load_submodule(package: str, name: str) -> ModuleType:
    """Import ``package.name`` when it exists; otherwise raise the usual AttributeError."""
    if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves each path of :data:`MOVED_MODULES` as the module that defines it."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        defining = importlib.util.find_spec(MOVED_MODULES[fullname])
        if defining is None:
            return None
        # origin: what `python -m PATH` shows as sys.argv[0]; loader_state: the defining
        # module's own spec, put back on it once the import machinery has overwritten it.
        return importlib.machinery.ModuleSpec(
            fullname, self, origin=defining.origin, loader_state=defining
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        # Already executed under its own name; undo the machinery's __spec__ overwrite.
        alias_spec = module.__spec__
        if alias_spec is not None and alias_spec.loader is self:
            module.__spec__ = alias_spec.loader_state

    def get_code(self, fullname: str) -> CodeType | None:
        """The defining module's code (``runpy``: ``python -m shardspeed.utils.zero_to_fp32``)."""
        defining = importlib.util.find_spec(MOVED_MODULES[fullname])
        assert defining is not None and defining.loader is not None
        return defining.loader.get_code(defining.name)  # type: ignore[attr-defined]


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
