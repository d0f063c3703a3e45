"""Model compression during training (DeepSpeed's ``deepspeed.compression``).

Weight quantization (1-16 bits, a start -> target bit schedule), activation quantization,
sparse / row / head / channel pruning and layer reduction, configured by the
``compression_training`` block of the ds_config. See ``docs/compression.md``.

Entry points: :func:`init_compression`, :func:`redundancy_clean`,
:func:`student_initialization` (also at ``shardspeed.compression.compress``), the
:class:`compression_scheduler`, and :func:`build_compression_hook` for the engine.
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule
from shardspeed.compression.compress import (
    init_compression,
    redundancy_clean,
    student_initialization,
)
from shardspeed.compression.engine_hook import CompressionTrainingHook, build_compression_hook
from shardspeed.compression.helper import convert_conv1d_to_linear
from shardspeed.compression.scheduler import CompressionScheduler, compression_scheduler
from shardspeed.config.compression import CompressionConfig, get_compression_config

__all__ = [
    "CompressionConfig",
    "CompressionScheduler",
    "CompressionTrainingHook",
    "build_compression_hook",
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "get_compression_config",
    "init_compression",
    "redundancy_clean",
    "student_initialization",
]


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)  # config, constants-style paths, as DeepSpeed's
