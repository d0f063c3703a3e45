"""DeepSpeed's import path ``deepspeed.sequence``: Ulysses sequence parallelism.

The implementation lives in :mod:`shardspeed.parallel.sequence`; ``shardspeed.sequence.layer``
re-exports ``DistributedAttention`` where DeepSpeed scripts import it from.
"""

from __future__ import annotations

from shardspeed.sequence import layer
from shardspeed.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention", "layer"]
