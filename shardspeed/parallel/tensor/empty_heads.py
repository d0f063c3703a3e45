"""Attention on a tensor rank that holds no heads (AutoTP with fewer KV heads than ranks).

As in DeepSpeed, such a rank gets zero-width q/k/v shards: its query is ``(B, 0, T, D)``
and its row-parallel output projection adds zeros to the sum. Some attention kernels do
not accept zero heads: torch 2.11's CPU ``scaled_dot_product_attention`` dies of a
floating-point exception (SIGFPE, the whole process) where 2.13 returns an empty result.
So every attention module whose heads all live on other ranks gets its own copy of the
model config naming :data:`EMPTY_HEADS_ATTENTION`, a Hugging Face attention function that
returns the (empty) result without calling a kernel, still connected to the query for
autograd. Other ranks and every result are unchanged.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

EMPTY_HEADS_ATTENTION = "shardspeed_empty_heads"
_QUERY_PROJECTIONS = ("q_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")


def empty_heads_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of zero heads: query ``(B, 0, T, D)`` -> output ``(B, T, 0, D)``.

    The (empty) output depends on ``key`` and ``value`` too, as a kernel's would: the
    backward of every projection must run on every rank, since each ends in a collective
    (the column-parallel input gradient's all-reduce) that the other ranks also issue.
    """
    linked = 0.0 * (key.sum() + value.sum())  # a zero scalar in the graph of k and v
    return query.transpose(1, 2) + linked, None  # (B, T, 0, D)


def guard_empty_attention(model: nn.Module, tp_rank: int) -> int:
    """Route the attention of modules whose query projection is zero-width on ``tp_rank``
    to :func:`empty_heads_attention`; returns how many modules were routed."""
    targets = [m for m in model.modules() if _holds_no_heads(m, tp_rank)]
    if not targets:
        return 0
    from transformers import AttentionInterface

    AttentionInterface.register(EMPTY_HEADS_ATTENTION, empty_heads_attention)
    for module in targets:
        config = copy.copy(module.config)  # this module's own: the model's config is shared
        config._attn_implementation_internal = EMPTY_HEADS_ATTENTION
        module.config = config
    return len(targets)


def _holds_no_heads(module: nn.Module, tp_rank: int) -> bool:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation_internal"):
        return False
    proj = next((getattr(module, n) for n in _QUERY_PROJECTIONS if hasattr(module, n)), None)
    layout = getattr(proj, "layout", None)
    return layout is not None and layout.shard_size(tp_rank) == 0
