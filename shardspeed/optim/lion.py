"""Re-export of :class:`shardspeed.ops.lion.Lion` (the algorithm lives in ``ops/``)."""

from shardspeed.ops.lion import Lion

__all__ = ["Lion"]
