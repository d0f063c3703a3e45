"""DeepSpeed's ``deepspeed.runtime.comm``: batched collectives
(:mod:`.coalesced_collectives`), loaded on first attribute access."""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)
