"""``deepspeed.sequence.layer``: ``DistributedAttention`` (see :mod:`shardspeed.parallel.sequence.layer`)."""

from __future__ import annotations

from shardspeed.parallel.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention"]
