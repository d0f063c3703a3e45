"""The ds_config ``sparse_attention`` block -> a :class:`SparsityConfig`.

DeepSpeed's engine parsed the block into a dict (``mode`` plus the keys that mode reads) and
left building the config to the model code, which knows the head count. This does both:

>>> cfg = sparsity_config_from_config({"mode": "fixed", "block": 32}, num_heads=8)
>>> type(cfg).__name__, cfg.block, cfg.num_local_blocks
('FixedSparsityConfig', 32, 4)

Each mode passes the keys DeepSpeed's parser read for it (so defaults match a DeepSpeed run,
e.g. BigBird gets ``num_random_blocks`` 0 from the config, not the class default 1). One
addition: ``attention`` also reaches BigBird and BSLongformer, whose classes accept it but
whose DeepSpeed parser dropped it. Keys a mode does not read are accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardspeed.config.sparse_attention import SparseAttentionConfig
from shardspeed.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

_MODES: dict[str, tuple[type[SparsityConfig], tuple[str, ...]]] = {
    "dense": (DenseSparsityConfig, ("block",)),
    "fixed": (
        FixedSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_local_blocks",
            "num_global_blocks",
            "attention",
            "horizontal_global_attention",
            "num_different_global_patterns",
        ),
    ),
    "variable": (
        VariableSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_random_blocks",
            "local_window_blocks",
            "global_block_indices",
            "global_block_end_indices",
            "attention",
            "horizontal_global_attention",
        ),
    ),
    "bigbird": (
        BigBirdSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_random_blocks",
            "num_sliding_window_blocks",
            "num_global_blocks",
            "attention",
        ),
    ),
    "bslongformer": (
        BSLongformerSparsityConfig,
        (
            "block",
            "different_layout_per_head",
            "num_sliding_window_blocks",
            "global_block_indices",
            "global_block_end_indices",
            "attention",
        ),
    ),
}


def sparsity_config_from_config(
    block: SparseAttentionConfig | Mapping[str, Any], num_heads: int
) -> SparsityConfig:
    """Build the sparsity config a ds_config ``sparse_attention`` block describes.

    Args:
        block: the typed block (``ShardSpeedConfig.sparse_attention``) or the raw JSON dict
            (DeepSpeed's ``mode``/``block``/... keys; validated here).
        num_heads: attention heads of the layer the config is for (not in the ds_config).
    """
    if not isinstance(block, SparseAttentionConfig):
        if not isinstance(block, Mapping):
            raise ValueError(
                "sparse_attention must be a JSON object (a dict) or a SparseAttentionConfig, got "
                f"{type(block).__name__}."
            )
        block = SparseAttentionConfig.model_validate(dict(block))
    cls, keys = _MODES[block.mode]
    return cls(num_heads, **{key: getattr(block, key) for key in keys})
