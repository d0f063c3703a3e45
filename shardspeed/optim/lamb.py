"""Re-export of :class:`shardspeed.ops.lamb.Lamb` (the algorithm lives in ``ops/``)."""

from shardspeed.ops.lamb import Lamb

__all__ = ["Lamb"]
