"""``deepspeed.moe.layer``: the ``MoE`` layer."""

from __future__ import annotations

from shardspeed.parallel.moe.layer import MoE

__all__ = ["MoE"]
