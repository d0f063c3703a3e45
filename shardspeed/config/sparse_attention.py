"""``sparse_attention``: block-sparse attention layout (DeepSpeed removed it in 0.19.7; we keep it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from shardspeed.config.base import ConfigModel, Int, lower_str


class SparseAttentionConfig(ConfigModel):
    """``sparse_attention``: which block layout ``SparseSelfAttention`` builds.

    Keys that do not apply to the chosen ``mode`` are accepted and unused, as in DeepSpeed.
    """

    json_key = "sparse_attention"

    mode: Annotated[
        Literal["dense", "fixed", "variable", "bigbird", "bslongformer"],
        BeforeValidator(lower_str),
    ] = Field("fixed", description="Layout family.")
    block: Int = Field(16, ge=1, description="Block size in tokens.")
    different_layout_per_head: bool = Field(False, description="Give each head its own layout.")
    num_local_blocks: Int = Field(4, ge=1, description="fixed: blocks in a local window.")
    num_global_blocks: Int = Field(1, ge=0, description="fixed/bigbird: global blocks.")
    attention: Annotated[Literal["bidirectional", "unidirectional"], BeforeValidator(lower_str)] = (
        Field("bidirectional", description="Causal (unidirectional) or not.")
    )
    horizontal_global_attention: bool = Field(
        False, description="Global blocks also attend to every block (bidirectional only)."
    )
    num_different_global_patterns: Int = Field(
        1, ge=1, description="fixed: distinct global patterns across heads."
    )
    num_random_blocks: Int = Field(0, ge=0, description="variable/bigbird: random blocks per row.")
    local_window_blocks: list[int] = Field(
        default_factory=lambda: [4], description="variable: sizes of the local windows."
    )
    global_block_indices: list[int] = Field(
        default_factory=lambda: [0], description="variable/bslongformer: global block starts."
    )
    global_block_end_indices: list[int] | None = Field(
        None, description="variable/bslongformer: global block ends (None = one block each)."
    )
    num_sliding_window_blocks: Int = Field(
        3, ge=1, description="bigbird/bslongformer: blocks in the sliding window."
    )
