"""``deepspeed`` backed by ShardSpeed (the compatibility distribution).

``import deepspeed`` gives a module that forwards every name to :mod:`shardspeed`, and
``deepspeed.X.Y`` (``import deepspeed.runtime.engine``, ``from deepspeed.runtime.zero.config
import ...``) *is* the module ``shardspeed.X.Y``: the same objects, so ``isinstance`` checks
and monkeypatches behave as one library. ``__version__`` is this distribution's version
(``0.19.8+shardspeed.N``), the DeepSpeed API level shardspeed follows, because tools compare
it with DeepSpeed releases; ``deepspeed.shardspeed_version`` is ShardSpeed's own.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from types import ModuleType
from typing import Any

import shardspeed

_PREFIX = __name__ + "."

try:
    __version__ = importlib.metadata.version("deepspeed")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    __version__ = "0.19.8+shardspeed.1"
version = __version__
shardspeed_version = shardspeed.__version__


class _ShardSpeedAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``deepspeed.X.Y`` to the already-importable ``shardspeed.X.Y``."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        target = importlib.util.find_spec("shardspeed." + fullname[len(_PREFIX) :])
        if target is None:
            return None
        # origin: sys.argv[0] under `python -m deepspeed.X.Y`
        return importlib.util.spec_from_loader(fullname, self, origin=target.origin)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module("shardspeed." + spec.name[len(_PREFIX) :])

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed as shardspeed.X.Y

    def get_code(self, fullname: str) -> Any:
        """The module's code, for ``python -m deepspeed.utils.zero_to_fp32`` (runpy)."""
        target = importlib.util.find_spec("shardspeed." + fullname[len(_PREFIX) :])
        if target is None or target.loader is self:  # not found, or our own spec again
            return None
        return target.loader.get_code(target.name)


if not any(isinstance(finder, _ShardSpeedAlias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _ShardSpeedAlias())


def __getattr__(name: str) -> Any:
    return getattr(shardspeed, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(shardspeed)) | set(shardspeed.__all__))
