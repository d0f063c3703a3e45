"""DeepSpeed's ``deepspeed.moe`` import paths over :mod:`shardspeed.parallel.moe`.

``import shardspeed as deepspeed`` then ``deepspeed.moe.layer.MoE(...)``, or
``from shardspeed.moe.layer import MoE``. See ``docs/moe.md``.
"""

from __future__ import annotations

from shardspeed.moe import experts, layer, sharded_moe, utils
from shardspeed.moe.layer import MoE

__all__ = ["MoE", "experts", "layer", "sharded_moe", "utils"]
