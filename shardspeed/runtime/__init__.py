"""shardspeed.runtime (DeepSpeed's ``deepspeed.runtime``): the engine, ``initialize``, LR
schedules, the data loader, activation checkpointing and the pipeline runtime.

Submodules load on first attribute access (``shardspeed.runtime.lr_schedules``), so a bare
``import shardspeed`` reaches them as DeepSpeed's eager imports do.
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)
