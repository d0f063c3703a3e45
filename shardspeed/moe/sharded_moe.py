"""``deepspeed.moe.sharded_moe``: the gate, the layer core and the gating functions."""

from __future__ import annotations

from shardspeed.parallel.moe.ds_format import top1gating, top2gating, topkgating
from shardspeed.parallel.moe.gating import TopKGate, gumbel_rsample, multiplicative_jitter
from shardspeed.parallel.moe.layer import MOELayer

__all__ = [
    "MOELayer",
    "TopKGate",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]
