"""Op builders under DeepSpeed's names (``deepspeed.ops.op_builder``).

``CPUAdamBuilder().is_compatible()`` says whether ShardSpeed can provide the op here;
``CPUAdamBuilder().load()`` returns the module that implements it. ``cpu_adam`` is a
JIT-built native kernel; ``cpu_adagrad``, ``cpu_lion``, ``fused_adam``, ``fused_lamb``,
``fused_lion``, ``sparse_attn``, ``utils`` and ``async_io`` are ShardSpeed Python
modules; every other DeepSpeed op is importable but never compatible, and its ``load()``
raises :class:`OpNotAvailableError` saying what to use instead. See
:mod:`shardspeed.ops.op_builder.builder`. Importing this package imports no torch.
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule
from shardspeed.ops.op_builder.async_io import AsyncIOBuilder, GDSBuilder
from shardspeed.ops.op_builder.builder import (
    CUDAOpBuilder,
    OpBuilder,
    OpNotAvailableError,
    get_default_compute_capabilities,
)
from shardspeed.ops.op_builder.cpu_optim import CPUAdagradBuilder, CPUAdamBuilder, CPULionBuilder
from shardspeed.ops.op_builder.fused_optim import (
    FusedAdamBuilder,
    FusedLambBuilder,
    FusedLionBuilder,
)
from shardspeed.ops.op_builder.python_ops import SparseAttnBuilder, UtilsBuilder
from shardspeed.ops.op_builder.unavailable import (
    CCLCommBuilder,
    DeepCompileBuilder,
    EvoformerAttnBuilder,
    FPQuantizerBuilder,
    InferenceBuilder,
    InferenceCoreBuilder,
    InferenceCutlassBuilder,
    NotImplementedBuilder,
    PinMemoryBuilder,
    QuantizerBuilder,
    RaggedOpsBuilder,
    RaggedUtilsBuilder,
    RandomLTDBuilder,
    ShareMemCommBuilder,
    SpatialInferenceBuilder,
    StochasticTransformerBuilder,
    TransformerBuilder,
)

__all__ = [
    "AsyncIOBuilder",
    "CCLCommBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "CUDAOpBuilder",
    "DeepCompileBuilder",
    "EvoformerAttnBuilder",
    "FPQuantizerBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "GDSBuilder",
    "InferenceBuilder",
    "InferenceCoreBuilder",
    "InferenceCutlassBuilder",
    "NotImplementedBuilder",
    "OpBuilder",
    "OpNotAvailableError",
    "PinMemoryBuilder",
    "QuantizerBuilder",
    "RaggedOpsBuilder",
    "RaggedUtilsBuilder",
    "RandomLTDBuilder",
    "ShareMemCommBuilder",
    "SparseAttnBuilder",
    "SpatialInferenceBuilder",
    "StochasticTransformerBuilder",
    "TransformerBuilder",
    "UtilsBuilder",
    "get_default_compute_capabilities",
]


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)  # all_ops, builder, ... as after DeepSpeed's import
