"""Builders of ops that ShardSpeed implements in PyTorch: ``SparseAttnBuilder``, ``UtilsBuilder``.

``sparse_attn``: :mod:`shardspeed.ops.sparse_attention` (a Triton kernel on CUDA, a
PyTorch one elsewhere; DeepSpeed 0.19.7 removed this op, ShardSpeed keeps it).
``utils``: :mod:`shardspeed.ops.op_builder.flatten_op`, DeepSpeed's ``flatten`` /
``unflatten`` of tensor lists.
"""

from __future__ import annotations

from shardspeed.ops.op_builder.builder import PythonOpBuilder


class SparseAttnBuilder(PythonOpBuilder):
    """Block-sparse attention: :mod:`shardspeed.ops.sparse_attention`."""

    BUILD_VAR = "DS_BUILD_SPARSE_ATTN"
    NAME = "sparse_attn"
    ABSOLUTE_NAME = "shardspeed.ops.sparse_attention"


class UtilsBuilder(PythonOpBuilder):
    """``flatten`` / ``unflatten`` of tensor lists: :mod:`shardspeed.ops.op_builder.flatten_op`."""

    BUILD_VAR = "DS_BUILD_UTILS"
    NAME = "utils"
    ABSOLUTE_NAME = "shardspeed.ops.op_builder.flatten_op"
