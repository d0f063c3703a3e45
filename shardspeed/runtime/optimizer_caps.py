"""What the engine needs to know about the basic optimizer, read once when it is built.

The engine steps the user's (or the config's) torch optimizer over flat master buckets.
Some optimizers need more than that, and say so by what they define:

* ``reduces_gradients = True`` (the 1-bit Adam family): they average gradients
  themselves, so the engine hands them unreduced local gradients and the data group
  (``comm_group``); they step whole buckets, so only ZeRO stage 0 is allowed;
* ``set_param_segments()`` (LAMB, 1-bit LAMB): they compute per-parameter norms, so the
  engine tells them where each parameter sits in the flat masters (and over which ranks
  its other elements live when the masters are sharded);
* ``set_matrix_layout()`` (Muon): it orthogonalises whole matrices, so the engine tells
  it where each parameter's fragment sits and its shape, and which ranks hold the rest of
  each bucket (it gathers them), and for a tensor-parallel shard how to rebuild its full
  matrix over the tensor axis; every stage, NVMe optimizer offload refused;
* none of these and not elementwise (:func:`shardspeed.optim.is_elementwise`): refused, since
  an update of a flat 1/N shard would differ from the update of whole tensors.

:class:`OptimizerCaps` records those answers once; :meth:`OptimizerCaps.connect` checks
them against the layout and hands the optimizer what it asks for. The engine never probes
the optimizer again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.config import ShardSpeedConfig
from shardspeed.config.optimizer import OptimizerConfig
from shardspeed.runtime.expert_layout import uses_fused_adam
from shardspeed.runtime.pipe.module import PipelineModule
from shardspeed.topology import Topology
from shardspeed.utils.logging import info_once
from shardspeed.zero.fragments import param_fragments
from shardspeed.zero.grad_reduction import BucketedReduction, GradReduction, LocalGradients
from shardspeed.zero.sharding import ShardAxis

# per optimizer param group: one list per master of (offset in the master, numel, index
# of the parameter in its group)
Segments = list[list[tuple[int, int, int]]]


@dataclass(frozen=True)
class OptimizerCaps:
    """The basic optimizer's capabilities (all False / True-elementwise without one)."""

    name: str  # class name, for messages ("" without an optimizer)
    reduces_gradients: bool  # averages its own gradients (1-bit family): local grads
    per_param_segments: bool  # has set_param_segments(): per-parameter norms on flat masters
    whole_matrices: bool  # has set_matrix_layout(): Muon's per-matrix Newton-Schulz
    elementwise: bool  # each element's update depends only on that element
    fused_adam: bool  # DeepSpeed would step it as FusedAdam (picks the MoE clipping norm)

    @classmethod
    def of(
        cls, optimizer: torch.optim.Optimizer | None, config_optimizer: OptimizerConfig | None
    ) -> OptimizerCaps:
        from shardspeed.optim import is_elementwise

        return cls(
            name="" if optimizer is None else type(optimizer).__name__,
            reduces_gradients=bool(getattr(optimizer, "reduces_gradients", False)),
            per_param_segments=hasattr(optimizer, "set_param_segments"),
            whole_matrices=hasattr(optimizer, "set_matrix_layout"),
            elementwise=optimizer is None or is_elementwise(optimizer),
            fused_adam=uses_fused_adam(optimizer, config_optimizer),
        )

    @property
    def supported(self) -> bool:
        """Whether the engine can step it over flat (possibly sharded) masters."""
        return self.elementwise or self.per_param_segments or self.whole_matrices

    def grad_reduction(self, axis: ShardAxis, average_over: int) -> GradReduction:
        """The communication seam: an optimizer that reduces by itself gets local grads.
        Every gradient is averaged over all data ranks (expert ones are summed over fewer)."""
        if self.reduces_gradients:
            return LocalGradients()
        return BucketedReduction(axis.group, axis.size, average_over=average_over)

    def check(self, stage: int, sharded: bool, tensor_parallel: bool) -> None:
        """Refuse a layout this optimizer cannot step (``ValueError`` naming the fix)."""
        if self.reduces_gradients and sharded:
            raise ValueError(
                f"optimizer {self.name} compresses its own gradient communication "
                f"and needs whole parameters, but zero_optimization.stage={stage} shards "
                "them. Fix: set zero_optimization.stage to 0 (as DeepSpeed requires)."
            )
        if self.per_param_segments and tensor_parallel:
            raise ValueError(
                f"optimizer {self.name} computes per-parameter norms, which tensor-"
                "parallel shards would need summed over the tensor axis (not implemented). "
                "Fix: use an elementwise optimizer (Adam, AdamW, SGD, Lion) with tensor_parallel."
            )
        if not self.supported:
            raise ValueError(
                f"optimizer {self.name} is not elementwise (e.g. per-parameter "
                "norms) and has no set_param_segments() to learn where each parameter sits in "
                f"the engine's flat buckets (zero_optimization.stage={stage}). Use Adam, "
                "AdamW, SGD, Adagrad, Lion or LAMB, or train it with plain PyTorch."
            )

    def connect(
        self,
        optimizer: Any,
        *,
        sharding: Any,
        topology: Topology,
        dp_group: Any,
        shard_axes: Sequence[ShardAxis],
        sharded_group_mask: Sequence[bool],
    ) -> None:
        """Check the layout (:meth:`check`), then hand the optimizer what it asks for: the
        data group to average over, and where each parameter sits in the flat masters."""
        sharded = sharding.shards_optimizer_state
        self.check(sharding.ctx.stage, sharded, topology.size("tensor") > 1)
        if self.reduces_gradients:
            optimizer.comm_group = dp_group
        if self.per_param_segments:
            optimizer.set_param_segments(
                *param_segments(sharding.groups, shard_axes, sharded_group_mask, sharded)
            )
        if self.whole_matrices:
            if sharding.ctx.offload.optimizer_swapper is not None:
                raise ValueError(
                    f"optimizer {self.name} gathers whole matrices across each bucket, which "
                    "the NVMe optimizer swapper does not hold. Fix: use zero_optimization."
                    'offload_optimizer.device "cpu" or "none" with Muon.'
                )
            tp_group = topology.group("tensor") if topology.size("tensor") > 1 else None
            layout, gather_groups = matrix_layout(
                sharding.groups, shard_axes, sharded_group_mask, tp_group
            )
            optimizer.set_matrix_layout(layout, gather_groups, sharding.ctx.device)
            if tp_group is not None:  # each tensor-parallel matrix gather is a collective
                from shardspeed.parallel.tensor.full_matrix import check_same_order

                check_same_order(optimizer.tensor_gather_order(), tp_group, self.name)


def param_segments(
    flat_groups: Sequence[Any],
    shard_axes: Sequence[ShardAxis],
    sharded_group_mask: Sequence[bool],
    sharded: bool,
) -> tuple[list[Segments], list[Any], list[int]]:
    """Per optimizer param group (``sharded_group_mask``: which of them hold a flat group):
    ``(offset, numel, index in its group)`` per master, the shard axis group whose ranks
    hold the parameters' other elements (None when unsharded), and the parameter count."""
    segments: list[Segments] = []
    groups: list[Any] = []
    counts: list[int] = []
    sharded_groups = iter(zip(flat_groups, shard_axes))
    for has_shard in sharded_group_mask:
        if not has_shard:
            segments.append([])
            groups.append(None)
            counts.append(0)
            continue
        group, axis = next(sharded_groups)
        index = {id(p): i for i, p in enumerate(group.params)}
        per_master: Segments = [[] for _ in group.masters]
        for f in param_fragments(group):
            per_master[f.master_index].append((f.local, f.length, index[id(f.param)]))
        segments.append(per_master)
        groups.append(axis.group if sharded and axis.size > 1 else None)
        counts.append(len(group.params))
    return segments, groups, counts


def matrix_layout(
    flat_groups: Sequence[Any],
    shard_axes: Sequence[ShardAxis],
    sharded_group_mask: Sequence[bool],
    tensor_group: Any = None,
) -> tuple[list[list[list[tuple[Any, ...]]]], list[Any]]:
    """Per optimizer param group, per master: ``(local, length, start, shape,
    bucket_offset, split)`` of each parameter fragment (``bucket_offset``: where the
    parameter starts in its whole bucket, this rank's shard being slice ``axis.rank`` of
    it; ``split``: a tensor-parallel parameter's
    :class:`~shardspeed.parallel.tensor.full_matrix.TensorSplit` over ``tensor_group``,
    else None), and the process group holding the bucket's other slices (None when not
    sharded)."""
    from shardspeed.parallel.tensor.full_matrix import tensor_split_of

    layout: list[list[list[tuple[Any, ...]]]] = []
    gather: list[Any] = []
    sharded_groups = iter(zip(flat_groups, shard_axes))
    for has_shard in sharded_group_mask:
        if not has_shard:
            layout.append([])
            gather.append(None)
            continue
        group, axis = next(sharded_groups)
        shard_rank, shard_world = 0, 1  # this rank's slice of every bucket of the group
        for bucket_layout, rank, *_ in group.layouts():
            shard_rank, shard_world = rank, bucket_layout.shard_world_size
        per_master: list[list[tuple[Any, ...]]] = [[] for _ in group.masters]
        for f in param_fragments(group):
            offset = shard_rank * group.masters[f.master_index].numel() + f.local - f.start
            split = tensor_split_of(f.param, tensor_group) if tensor_group is not None else None
            per_master[f.master_index].append(
                (f.local, f.length, f.start, list(f.shape), offset, split)
            )
        layout.append(per_master)
        gather.append(axis.group if shard_world > 1 else None)
    return layout, gather


def takes_initial_zero_grad_step(
    config: ShardSpeedConfig, sharded: bool, param_dtype: torch.dtype, module: Any
) -> bool:
    """Whether DeepSpeed 0.19.8 would step this optimizer once with zero gradients when
    built: its 16-bit ZeRO-0 wrappers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``,
    for client and config optimizers alike) do; its ZeRO optimizers (``sharded``), fp32
    training and the bf16 pipeline optimizer (``BF16_Optimizer``) do not. Config
    ``initial_zero_grad_step: "none"`` turns it off."""
    if config.initial_zero_grad_step != "deepspeed" or sharded:
        return False
    if param_dtype == torch.bfloat16:
        return not isinstance(module, PipelineModule)
    return param_dtype == torch.float16


def initial_zero_grad_step(optimizer: Any, param_dtype: torch.dtype, global_rank: int) -> None:
    """DeepSpeed's ``initialize_optimizer_states`` (see :func:`takes_initial_zero_grad_step`)
    on the engine's ``ShardedOptimizer``."""
    optimizer.step_with_zero_grads()
    if global_rank == 0:
        info_once(
            f"ZeRO stage 0 with {param_dtype} parameters: stepped the "
            "optimizer once with zero gradients at construction, as DeepSpeed 0.19.8 does "
            "(Adam's first real update is then about 0.74 lr; weight decay, if any, moved "
            'the masters once). Set "initial_zero_grad_step": "none" in the config to skip '
            "it.",
            __name__,
        )
