"""Optimizers: the ds_config factory and ShardSpeed's own LAMB and Lion.

``build_optimizer(type_name, params, param_groups, offload=False)`` maps a ds_config
``optimizer`` block to a torch optimizer; ``is_elementwise(optimizer)`` tells the sharding
engine whether the optimizer can step a flat 1/N shard of concatenated parameters.
"""

from __future__ import annotations

from shardspeed.ops.lamb import Lamb
from shardspeed.ops.lion import Lion
from shardspeed.optim.factory import (
    OPTIMIZER_NAMES,
    build_optimizer,
    is_elementwise,
    optimizer_names,
    register_optimizer,
)

__all__ = [
    "OPTIMIZER_NAMES",
    "Lamb",
    "Lion",
    "build_optimizer",
    "is_elementwise",
    "optimizer_names",
    "register_optimizer",
]
