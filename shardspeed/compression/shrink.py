"""Folding one group of one technique into plain weights (``redundancy_clean``'s work).

For structured pruning with ``related_modules``, the mask of each pruned module is passed to
its related modules by position: the j-th module matched by a related pattern takes the mask
of the j-th module matched by the group's own pattern (layer 0's output projection -> layer
0's q/k/v, ...).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardspeed.compression.attention_heads import HeadCountSync
from shardspeed.compression.matching import get_submodule
from shardspeed.compression.plan import GroupPlan
from shardspeed.config.compression import (
    CHANNEL_PRUNING,
    HEAD_PRUNING,
    ROW_PRUNING,
    SPARSE_PRUNING,
    WEIGHT_QUANTIZATION,
)

logger = logging.getLogger(__name__)

_HEAD_COUNT_ATTRS = ("num_attention_heads", "num_heads", "n_head", "n_heads")


def _fold(
    module: nn.Module, plan: GroupPlan, mask: torch.Tensor | None, dim_reduction: bool
) -> torch.Tensor | None:
    technique = plan.technique
    if technique == WEIGHT_QUANTIZATION:
        module.fix_weight_quantization()
        return None
    if technique == SPARSE_PRUNING:
        module.fix_sparse_pruning()
        return None
    if technique == ROW_PRUNING:
        return module.fix_row_pruning(mask, dim_reduction=dim_reduction)
    if technique == HEAD_PRUNING:
        return module.fix_head_pruning(mask, plan.shared.num_heads, dim_reduction=dim_reduction)
    if technique == CHANNEL_PRUNING:
        return module.fix_channel_pruning(mask, dim_reduction=dim_reduction)
    return None  # activation quantization stays in the model


def _update_head_counts(model: nn.Module, qkv_name: str, num_heads: int, kept: int) -> None:
    """Set the head count of the attention module that owns a pruned q/k/v projection."""
    parent_name = qkv_name.rpartition(".")[0]
    parent = get_submodule(model, parent_name) if parent_name else model
    qkv = get_submodule(model, qkv_name)
    for attr in _HEAD_COUNT_ATTRS:
        if getattr(parent, attr, None) == num_heads:
            setattr(parent, attr, kept)
    if isinstance(getattr(parent, "all_head_size", None), int):
        parent.all_head_size = qkv.out_features


def fold_group(model: nn.Module, plan: GroupPlan, heads: HeadCountSync | None = None) -> None:
    """Fold ``plan``'s technique in each of its modules (and shrink related modules);
    ``heads`` records the heads each HF attention kept (its config follows later)."""
    for target in plan.targets:
        reduce = bool(target.related)
        masks = [_fold(get_submodule(model, name), plan, None, reduce) for name in target.modules]
        if plan.technique == HEAD_PRUNING and reduce and heads is not None:
            for name, mask in zip(target.modules, masks, strict=True):
                if mask is not None:
                    heads.record(model, name, plan.shared.num_heads, int(mask.sum()))
        for related_names in target.related:
            if len(related_names) != len(masks):
                raise ValueError(
                    f"compression_training.{plan.technique}.different_groups.{plan.name}: "
                    f"{len(related_names)} related module(s) {related_names} for "
                    f"{len(masks)} pruned module(s) {target.modules}; allowed: one related "
                    "module per pruned module for each related pattern. Fix: make the "
                    "related pattern match exactly the modules that follow the pruned ones."
                )
            for name, mask in zip(related_names, masks, strict=True):
                if mask is None:
                    continue
                _fold(get_submodule(model, name), plan, mask, True)
                if plan.technique == HEAD_PRUNING:
                    _update_head_counts(model, name, plan.shared.num_heads, int(mask.sum()))
