"""DeepSpeed's ``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` section
models (:mod:`shardspeed.config.precision`, same keys) and DeepSpeed's two readers."""

from __future__ import annotations

from typing import Any

from shardspeed.config.precision import BF16Config, FP16Config

DeepSpeedFP16Config = FP16Config
DeepSpeedBF16Config = BF16Config
FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # DeepSpeed's legacy key


def get_float16_config(param_dict: dict[str, Any]) -> FP16Config:
    """The ``fp16`` block of a ds_config dict, validated."""
    return FP16Config.model_validate(param_dict.get(FP16, {}))


def get_bfloat16_config(param_dict: dict[str, Any]) -> BF16Config:
    """The ``bf16`` block (or the legacy ``bfloat16``) of a ds_config dict, validated."""
    block = param_dict.get(BFLOAT16)
    return BF16Config.model_validate(
        block if block is not None else param_dict.get(BFLOAT16_OLD, {})
    )


__all__ = [
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "get_bfloat16_config",
    "get_float16_config",
]
