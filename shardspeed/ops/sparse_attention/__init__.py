"""Block-sparse self-attention with DeepSpeed's API (``deepspeed.ops.sparse_attention``).

DeepSpeed removed this package in 0.19.7; shardspeed keeps its classes and exact layouts and
runs them with kernels that compute only the layout's blocks: a Triton kernel on CUDA
(``triton_kernels.py``) and a pure-PyTorch one elsewhere (``kernel_choice.py`` picks). See
``docs/sparse_attention.md``.

>>> from shardspeed.ops.sparse_attention import FixedSparsityConfig, SparseSelfAttention
>>> attn = SparseSelfAttention(FixedSparsityConfig(num_heads=4, block=16), max_seq_length=256)
"""

from __future__ import annotations

from shardspeed.ops.sparse_attention.bert_sparse_self_attention import (
    BertSparseSelfAttention,
    HFBertSparseSelfAttention,
)
from shardspeed.ops.sparse_attention.block_plan import BlockPlan, build_plan
from shardspeed.ops.sparse_attention.block_sparse import block_sparse_attention
from shardspeed.ops.sparse_attention.from_config import sparsity_config_from_config
from shardspeed.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from shardspeed.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from shardspeed.ops.sparse_attention.utils import SparseAttentionUtils

__all__ = [
    "BSLongformerSparsityConfig",
    "BertSparseSelfAttention",
    "BigBirdSparsityConfig",
    "BlockPlan",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "HFBertSparseSelfAttention",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "build_plan",
    "sparsity_config_from_config",
]
