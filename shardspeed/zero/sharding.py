"""Sharding policies: how the engine lays out parameters, gradients and masters per stage.

The engine is one class; the ZeRO stage picks one of two layouts of the same mechanism
(padded flat buffers laid out by :mod:`shardspeed.zero.partition`, this rank owning one
slice of each):

* :class:`FlatSharding` (stages 0-2): each optimizer param group is one
  :class:`~shardspeed.zero.flat_buffer.FlatGroup` of several buckets; parameters stay
  gathered (``reshard_after_forward`` never happens), so after a step the updated slices
  are all-gathered back into the parameters;
* :class:`~shardspeed.zero.unit_sharding.UnitSharding` (stage 3): each (module unit,
  param group) is one single-bucket flat that is gathered around the unit's forward and
  backward and released after (FSDP2's ``reshard_after_forward=True``).

Both expose the same small surface to the engine: ``groups`` (what the optimizer steps),
``grad_slots()`` (what the reducer reduces, in launch order), ``reduction_policy()``,
``publish()`` (masters have been written into the parameter shards: make the parameters
usable), ``full_state_dict()``/``load_full_state_dict()``, ``remove()``, and the stage's
answers to the engine's questions (``shards_optimizer_state``, ``allows_no_sync``,
``load_updates_masters``), so the engine never compares stage numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.zero.flat_buffer import FlatGroup
from shardspeed.zero.grad_reduction import scatters_via_all_reduce
from shardspeed.zero.offload import OffloadRuntime
from shardspeed.zero.reducer import GradSlot, ReductionPolicy


@dataclass(frozen=True)
class ShardAxis:
    """The ranks one param group is sharded and reduced over: the data axis for dense
    parameters, an expert-data axis for expert parameters."""

    group: Any
    size: int
    rank: int


@dataclass(frozen=True)
class ShardingContext:
    """Everything a sharding policy needs to know about the job, resolved by the engine."""

    stage: int
    dp_group: Any  # the data axis (stage-3 order checks run over it)
    dp_world_size: int
    axes: Sequence[ShardAxis]  # per optimizer param group
    device: torch.device
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    offload: OffloadRuntime
    zero: Any  # the typed zero_optimization config block
    overlap: bool
    pre_factor: float


class FlatSharding:
    """Stages 0-2: one multi-bucket :class:`FlatGroup` per param group, params kept whole."""

    def __init__(self, ctx: ShardingContext, groups: list[dict[str, Any]]) -> None:
        self.ctx = ctx
        sharded = ctx.stage >= 1
        self.groups = [
            FlatGroup(
                g["params"],
                shard_world_size=axis.size if sharded else 1,
                shard_rank=axis.rank if sharded else 0,
                bucket_size=int(ctx.zero.reduce_bucket_size),
                param_dtype=ctx.param_dtype,
                grad_dtype=ctx.grad_dtype,
                master_dtype=ctx.master_dtype,
                full_grads=ctx.stage <= 1,
                device=ctx.device,
                offload=ctx.offload,
            )
            for g, axis in zip(groups, ctx.axes)
        ]

    def describe(self) -> str:
        return f"{sum(len(g.buckets) for g in self.groups)} buckets"

    def grad_slots(self) -> list[GradSlot]:
        """Every bucket, or every comm span of it (:meth:`overlap_span_sizes`), the one
        holding the latest-registered parameters first (gradients arrive roughly in reverse
        registration order)."""
        slots = [
            s
            for i, (g, axis) in enumerate(zip(self.groups, self.ctx.axes))
            for s in g.grad_slots(i, *self.overlap_span_sizes(g, axis))
        ]
        last = {id(s): max(s.span.param_indices, default=-1) for s in slots}
        return sorted(slots, key=lambda s: -last[id(s)])

    def overlap_span_sizes(self, group: FlatGroup, axis: ShardAxis) -> tuple[int, int]:
        """(span, first span) elements per gradient collective for ``group``; (0, 0) keeps
        one collective per bucket.

        Buckets are split (DDP's bucketing: ``overlap_bucket_size`` parts, the first 1/25
        of it) only where that cannot cost anything but the per-call latency: when
        reductions overlap backward at all, the optimizer is not offloaded (host copies go
        per bucket), and the bucket would be all-reduced anyway (stage 0, or a backend that
        scatters via all-reduce; a reduce-scatter of a part would not give this rank its
        slice).
        """
        size = int(self.ctx.zero.overlap_bucket_size)
        if not self.ctx.overlap or size <= 0 or group.host_grads:
            return 0, 0
        if group.layout.shard_world_size > 1 and not scatters_via_all_reduce(axis.group):
            return 0, 0
        return size, max(size // 25, 1)

    def reduction_policy(self) -> ReductionPolicy:
        ctx = self.ctx
        return ReductionPolicy(
            every_micro_step=ctx.stage == 2,
            reduce_dtype=ctx.reduce_dtype,
            overlap=ctx.overlap,
            pre_factor=ctx.pre_factor,
            tag=f"zero{ctx.stage}.reduce_grads",
        )

    @torch.no_grad()
    def publish(self) -> None:
        """All-gather every bucket's updated slices into the full parameters (stages 1/2)."""
        works = []
        for group, axis in zip(self.groups, self.ctx.axes):
            if group.layout.shard_world_size == 1:
                continue
            for bucket in group.buckets:
                shard = group.param_shard(bucket).clone()
                works.append(
                    comm.all_gather_into_tensor(
                        group.bucket_params(bucket), shard, group=axis.group, async_op=True
                    )
                )
        for work in works:
            work.wait()

    def full_state_dict(self, module: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return module.state_dict(*args, **kwargs)

    def load_full_state_dict(self, module: nn.Module, state_dict: Any, strict: bool) -> Any:
        return module.load_state_dict(state_dict, strict=strict)

    def remove(self) -> None:
        """Nothing installed on the model besides the reducer's hooks."""

    # -- what the engine asks of the layout ------------------------------------------------
    @property
    def shards_optimizer_state(self) -> bool:
        """Stages 1/2: each rank holds and steps only its slice of the masters."""
        return self.ctx.stage >= 1

    @property
    def allows_no_sync(self) -> bool:
        """Stages 0/1: full gradients wait in the buffer until the boundary's reduction."""
        return self.ctx.stage <= 1

    @property
    def load_updates_masters(self) -> bool:
        """Loading a full state dict writes the parameters only; the engine then refreshes
        the masters from them."""
        return False


def build_sharding(
    ctx: ShardingContext, groups: list[dict[str, Any]], model: nn.Module
) -> FlatSharding | Any:
    """The layout for ``ctx.stage``: :class:`FlatSharding` (0-2) or ``UnitSharding`` (3)."""
    if ctx.stage == 3:
        from shardspeed.zero.unit_sharding import UnitSharding

        return UnitSharding(ctx, groups, model)
    from shardspeed.zero.init_partition import materialize_init_params

    materialize_init_params(model, f"zero.Init model trained at ZeRO stage {ctx.stage}")
    return FlatSharding(ctx, groups)
