"""DeepSpeed's ``deepspeed.runtime.zero.config``: the ``zero_optimization`` section model.

``DeepSpeedZeroConfig`` is :class:`shardspeed.config.ZeroConfig` (pydantic, same keys and
aliases); ``ZeroStageEnum`` names the stages as DeepSpeed does.
"""

from __future__ import annotations

from enum import IntEnum

from shardspeed.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

DeepSpeedZeroConfig = ZeroConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig


class ZeroStageEnum(IntEnum):
    """The ZeRO stages by what they shard (DeepSpeed's names)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "ZeroStageEnum",
]
