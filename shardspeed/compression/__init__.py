"""Model compression during training (DeepSpeed's ``deepspeed.compression``).

Weight quantization (1-16 bits, a start -> target bit schedule), activation quantization,
sparse / row / head / channel pruning and layer reduction, configured by the
``compression_training`` block of the ds_config. See ``docs/compression.md``.

Entry points: :func:`init_compression`, :func:`redundancy_clean`,
:func:`student_initialization` (also at ``shardspeed.compression.compress``), the
:class:`compression_scheduler`, :func:`build_compression_hook` for the engine, the
distillation losses (:func:`kd_loss`, :func:`hidden_state_mse`, :class:`capture_outputs`)
and :func:`set_weight_group_size` (kernel-shaped weight groups). DeepSpeed's layer classes
(``LinearLayer_Compress``, ...) are in :mod:`shardspeed.compression.basic_layer`.
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule
from shardspeed.compression.compress import (
    init_compression,
    redundancy_clean,
    student_initialization,
)
from shardspeed.compression.distillation import capture_outputs, hidden_state_mse, kd_loss
from shardspeed.compression.engine_hook import CompressionTrainingHook, build_compression_hook
from shardspeed.compression.group_size import set_weight_group_size
from shardspeed.compression.helper import convert_conv1d_to_linear
from shardspeed.compression.scheduler import CompressionScheduler, compression_scheduler
from shardspeed.config.compression import CompressionConfig, get_compression_config

__all__ = [
    "CompressionConfig",
    "CompressionScheduler",
    "CompressionTrainingHook",
    "build_compression_hook",
    "capture_outputs",
    "compression_scheduler",
    "convert_conv1d_to_linear",
    "get_compression_config",
    "hidden_state_mse",
    "init_compression",
    "kd_loss",
    "redundancy_clean",
    "set_weight_group_size",
    "student_initialization",
]


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)  # config, constants-style paths, as DeepSpeed's
