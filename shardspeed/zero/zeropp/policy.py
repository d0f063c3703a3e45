"""Which ZeRO++ pieces are on, read once from ``zero_optimization``, and what they build.

:class:`ZeroPPPolicy` mirrors DeepSpeed's three keys; :meth:`ZeroPPPolicy.build` creates
the process groups once (a collective) and returns the :class:`ZeroPP` the stage-3
sharding asks for each flat's weight gathers and each param group's gradient reduction.
ZeRO++ applies to the dense parameters (sharded over the data axis); expert parameters
(sharded over an expert-data axis) and the persistent flat of small parameters keep
plain gathers and reductions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.zero.zeropp.groups import ZeroPPGroups, build_groups
from shardspeed.zero.zeropp.weights import HpzGroup, WeightGathers


@dataclass(frozen=True)
class ZeroPPPolicy:
    """``zero_quantized_weights`` (qwZ), ``zero_hpz_partition_size`` (hpZ) and
    ``zero_quantized_gradients`` (qgZ)."""

    quantized_weights: bool = False
    hpz_partition_size: int = 1
    quantized_gradients: bool = False

    @classmethod
    def from_config(cls, zero: Any) -> ZeroPPPolicy:
        return cls(
            quantized_weights=bool(getattr(zero, "zero_quantized_weights", False)),
            hpz_partition_size=int(getattr(zero, "zero_hpz_partition_size", 1)),
            quantized_gradients=bool(getattr(zero, "zero_quantized_gradients", False)),
        )

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.hpz_partition_size > 1 or self.quantized_gradients

    def describe(self) -> str:
        parts = ["qwZ"] if self.quantized_weights else []
        if self.hpz_partition_size > 1:
            parts.append(f"hpZ {self.hpz_partition_size}")
        if self.quantized_gradients:
            parts.append("qgZ")
        return "ZeRO++ " + "+".join(parts) if parts else "ZeRO++ off"

    def build(self, dp_group: Any, dp_world_size: int) -> ZeroPP | None:
        """The groups and factories, or None when every piece is off."""
        if not self.enabled:
            return None
        groups = build_groups(dp_group, self.hpz_partition_size, self.quantized_gradients)
        return ZeroPP(self, groups, dp_group, dp_world_size)


class ZeroPP:
    """What the stage-3 sharding asks of ZeRO++ (see the module docstring)."""

    def __init__(
        self, policy: ZeroPPPolicy, groups: ZeroPPGroups, dp_group: Any, dp_world_size: int
    ) -> None:
        self.policy = policy
        self.groups = groups
        self.dp_group = dp_group
        self.dp_world_size = dp_world_size

    def weight_gathers(self, dtype: torch.dtype, device: torch.device) -> WeightGathers | None:
        """A new :class:`WeightGathers` for one dense unit flat (None: plain gathers)."""
        p, g = self.policy, self.groups
        if not p.quantized_weights and p.hpz_partition_size <= 1:
            return None
        hpz = HpzGroup(g.hpz, g.hpz_size, g.hpz_rank) if g.hpz is not None else None
        return WeightGathers(
            world=self.dp_world_size, dp_group=self.dp_group, quantized=p.quantized_weights,
            hpz=hpz, dtype=dtype, device=device,
        )  # fmt: skip

    def grad_reduction(self, default: Any) -> Any:
        """qgZ's :class:`QuantizedReduction` in place of the dense ``default`` reduction
        (kept as is when qgZ is off or the optimizer reduces its own gradients)."""
        from shardspeed.zero.grad_reduction import BucketedReduction
        from shardspeed.zero.zeropp.grads import QuantizedReduction

        if not self.policy.quantized_gradients or not isinstance(default, BucketedReduction):
            return default
        g = self.groups
        return QuantizedReduction(
            world_size=self.dp_world_size, intra=g.intra, intra_size=g.intra_size,
            inter=g.inter, inter_size=g.inter_size, average_over=default.average_over,
        )  # fmt: skip
