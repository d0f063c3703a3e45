"""shardspeed.zero: the sharding engine (ZeRO stages 0-3) and its user-facing helpers."""

from __future__ import annotations

from shardspeed.zero.init import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)
from shardspeed.zero.params import ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
