"""Fused inference modules for ``replace_with_kernel_inject=True`` (one concept per file).

* :mod:`~.fused_qkv`: one matmul for q, k and v.
* :mod:`~.rotary`: rotary embedding of queries and keys in one pass.
* :mod:`~.attention`: fused attention (QKV + rotary + SDPA with GQA, HF's KV cache).
* :mod:`~.fused_mlp`: gate and up projections in one matmul, then the activation.
* :mod:`~.inject`: swaps a model's modules for these.
"""

from __future__ import annotations

from shardspeed.inference.injection.attention import FusedAttention, sdpa_attention
from shardspeed.inference.injection.fused_mlp import FusedGatedMLP
from shardspeed.inference.injection.fused_qkv import FusedQKV
from shardspeed.inference.injection.inject import inject_fused_modules
from shardspeed.inference.injection.rotary import apply_rotary

__all__ = [
    "FusedAttention",
    "FusedGatedMLP",
    "FusedQKV",
    "apply_rotary",
    "inject_fused_modules",
    "sdpa_attention",
]
