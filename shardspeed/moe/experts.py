"""``deepspeed.moe.experts``: ``Experts``."""

from __future__ import annotations

from shardspeed.parallel.moe.experts import Experts

__all__ = ["Experts"]
