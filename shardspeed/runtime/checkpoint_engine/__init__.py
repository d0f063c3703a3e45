"""DeepSpeed's ``deepspeed.runtime.checkpoint_engine``: the pluggable writer of checkpoint
files, for code that builds or subclasses one (Nebula-style engines, custom storage).

ShardSpeed's own checkpoints (``engine.save_checkpoint``) are written by
:mod:`shardspeed.checkpoint` (safetensors shards, manifest, commit); this package holds
DeepSpeed's interface: :class:`CheckpointEngine` (``create`` / ``save`` / ``load`` /
``commit``) and :class:`TorchCheckpointEngine` (``torch.save`` / ``torch.load``).
"""

from __future__ import annotations

from shardspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from shardspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
    TorchCheckpointEngine,
    create_checkpoint_engine,
)

__all__ = [
    "CheckpointCommitInfo",
    "CheckpointEngine",
    "TorchCheckpointEngine",
    "create_checkpoint_engine",
]
