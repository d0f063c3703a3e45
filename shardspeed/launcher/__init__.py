"""The ``shardspeed`` command: a DeepSpeed-style launcher on top of ``torchrun``.

``shardspeed [launcher options] train.py [script args]`` starts one ``torchrun`` per node
(locally, or over ssh/pdsh for a hostfile) and gives every rank ``--local_rank=<n>`` like
the ``deepspeed`` launcher. ``shardspeed report`` prints the environment. See
``docs/launcher.md``. Nothing heavy is imported here.
"""

from __future__ import annotations

from shardspeed.launcher.errors import LauncherError

__all__ = ["LauncherError"]
