"""DeepSpeed's ``deepspeed.runtime.pipe.topology``: the process-grid classes, re-exported
from :mod:`shardspeed.parallel.pipeline.topology`."""

from __future__ import annotations

from shardspeed.parallel.pipeline.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
