"""The engine's construction steps that are plain functions of the config and the mesh.

Each builds one collaborator that ``ShardSpeedEngine.__init__`` assembles: the mesh axis
of each param group, the sharding context, the offload runtime, whether the step checks
for overflow, and the LR schedule. None of them holds state or reads the engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from shardspeed.config import ShardSpeedConfig
from shardspeed.precision.policy import MixedPrecision
from shardspeed.runtime.expert_layout import expert_axis, expert_name
from shardspeed.topology import Topology
from shardspeed.zero.offload import OffloadRuntime
from shardspeed.zero.sharding import ShardAxis, ShardingContext


def dense_axis(topology: Topology) -> str:
    """What dense parameters are sharded and reduced over: the data axis, and with
    sequence parallelism data x sequence (every sequence rank holds the whole model
    and the gradient of its own tokens; gradients are averaged over data ranks only)."""
    return "data_sequence" if topology.size("sequence") > 1 else "data"


def shard_axis(topology: Topology, params: list[nn.Parameter]) -> ShardAxis:
    """The ranks a param group is sharded and reduced over: the data axis, or the
    ``expert_data`` axis of its experts (:mod:`shardspeed.runtime.expert_layout`)."""
    name = expert_name(params)
    if name is not None:
        return expert_axis(name)
    axis = dense_axis(topology)
    return ShardAxis(topology.group(axis), topology.size(axis), topology.rank_in(axis))


def sharding_context(
    config: ShardSpeedConfig,
    topology: Topology,
    precision: MixedPrecision,
    axes: list[ShardAxis],
    device: torch.device,
    offload: OffloadRuntime,
) -> ShardingContext:
    """What the stage's sharding layout needs to know, resolved from config and mesh."""
    zero, p = config.zero_optimization, precision
    return ShardingContext(
        stage=zero.stage,
        dp_group=topology.group(dense_axis(topology)),
        dp_world_size=topology.size(dense_axis(topology)),
        axes=axes,
        device=device,
        param_dtype=p.param_dtype,
        grad_dtype=p.grad_dtype(config.gradient_accumulation_steps),
        reduce_dtype=p.reduce_dtype,
        master_dtype=p.master_dtype,
        offload=offload,
        zero=zero,
        overlap=zero.overlap_comm,
        pre_factor=config.gradient_predivide_factor if config.prescale_gradients else 1.0,
    )


def build_offload(
    config: ShardSpeedConfig,
    precision: MixedPrecision,
    *,
    client_optimizer: Any,
    rank: int,
    device: torch.device,
    numel: int,
    dp_world_size: int,
) -> OffloadRuntime:
    """Optimizer (and, at stage 3, parameter) offload as the config asks: none/cpu/nvme."""
    return OffloadRuntime.from_config(
        config,
        has_optimizer=client_optimizer is not None or config.optimizer is not None,
        rank=rank,
        device=device,
        numel_per_rank=-(-numel // dp_world_size),
        param_dtype=precision.param_dtype,
        master_dtype=precision.master_dtype,
    )


def checks_overflow(config: ShardSpeedConfig, precision: MixedPrecision) -> bool:
    """fp16 always checks gradients for inf/nan; bf16 unless ``bf16.check_grad_overflow``
    is false; fp32 never."""
    if precision.param_dtype == torch.float16:
        return True
    if precision.param_dtype == torch.bfloat16:
        return bool(getattr(config.bf16, "check_grad_overflow", True))
    return False


def build_lr_scheduler(config: ShardSpeedConfig, lr_scheduler: Any, optimizer: Any) -> Any:
    """The client's scheduler (a factory is called with ``optimizer``), else the config's
    ``scheduler`` block over ``optimizer``, else None."""
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if config.scheduler is not None and optimizer is not None:
        from shardspeed.runtime.lr_schedules import build_lr_scheduler as from_config

        sched = config.scheduler
        return from_config(sched.type, dict(sched.params), optimizer)
    return None
