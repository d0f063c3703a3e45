"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` (used by transformers'
ZeRO-3 ``from_pretrained``): re-exports :mod:`shardspeed.zero`'s construction-time
partitioning, where the implementation lives."""

from __future__ import annotations

from shardspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
