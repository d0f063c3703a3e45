"""GPU optimizer op builders: ``FusedAdamBuilder``, ``FusedLambBuilder``, ``FusedLionBuilder``.

DeepSpeed compiles multi-tensor CUDA kernels for these. ShardSpeed's ``FusedAdam`` runs
torch's fused Adam kernel and ``FusedLamb`` / ``FusedLion`` run PyTorch foreach kernels,
on CUDA and on CPU alike, so there is nothing to build: ``load()`` returns the module that
holds the optimizer class.
"""

from __future__ import annotations

from shardspeed.ops.op_builder.builder import PythonOpBuilder


class FusedAdamBuilder(PythonOpBuilder):
    """``FusedAdam`` (torch's fused Adam/AdamW kernel): :mod:`shardspeed.ops.adam`."""

    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    NAME = "fused_adam"
    ABSOLUTE_NAME = "shardspeed.ops.adam"


class FusedLambBuilder(PythonOpBuilder):
    """``FusedLamb`` (foreach kernels): :mod:`shardspeed.ops.lamb`."""

    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    NAME = "fused_lamb"
    ABSOLUTE_NAME = "shardspeed.ops.lamb"


class FusedLionBuilder(PythonOpBuilder):
    """``FusedLion`` (foreach kernels): :mod:`shardspeed.ops.lion`."""

    BUILD_VAR = "DS_BUILD_FUSED_LION"
    NAME = "fused_lion"
    ABSOLUTE_NAME = "shardspeed.ops.lion"
