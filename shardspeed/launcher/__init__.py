"""The ``shardspeed`` command: a DeepSpeed-style launcher on top of ``torchrun``.

``shardspeed [launcher options] train.py [script args]`` starts one ``torchrun`` per node
(locally, or over ssh/pdsh for a hostfile) and gives every rank ``--local_rank=<n>`` like
the ``deepspeed`` launcher. ``shardspeed report`` prints the environment. See
``docs/launcher.md``. Nothing heavy is imported here.
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule
from shardspeed.launcher.errors import LauncherError

__all__ = ["LauncherError"]


def __getattr__(name: str) -> ModuleType:
    """Submodules on first attribute access (``deepspeed.launcher.runner`` after an import)."""
    return load_submodule(__name__, name)
