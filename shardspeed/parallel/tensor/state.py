"""Full (unsharded) tensors of a tensor-parallel model, in the model's own names and layout.

* :func:`gather_full_state_dict`: every ``state_dict`` entry, sharded ones all-gathered over
  their tensor group and reassembled (fused q/k/v in their original order) -- what
  ``save_16bit_model`` / ``engine.state_dict()`` must return.
* :func:`load_full_state_dict`: copy full tensors (a pretrained checkpoint) into the shards,
  slicing each by its :class:`~.partition.ShardLayout`.

A parameter is sharded when it carries ``tensor_model_parallel`` and ``tp_layout`` (set by
the layers of :mod:`~.layers`); its group is the owning layer's ``group``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.parallel.tensor.comm_ops import all_gather_pieces
from shardspeed.parallel.tensor.partition import ShardLayout, assemble, slice_shard


def _tensor_groups(model: nn.Module) -> dict[int, Any]:
    """id(sharded parameter) -> the tensor group of the layer that owns it."""
    groups = {}
    for module in model.modules():
        group = getattr(module, "group", None)
        for param in module.parameters(recurse=False):
            if getattr(param, "tensor_model_parallel", False):
                groups[id(param)] = group
    return groups


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape of ``param`` (its own shape when it is replicated)."""
    layout: ShardLayout | None = getattr(param, "tp_layout", None)
    shape = list(param.shape)
    if layout is not None:
        shape[layout.dim] = layout.full_size
    return tuple(shape)


@torch.no_grad()
def gather_full_tensor(param: torch.Tensor, group: Any) -> torch.Tensor:
    """The full tensor of one shard (collective over ``group``); a copy of replicated ones."""
    layout: ShardLayout | None = getattr(param, "tp_layout", None)
    if layout is None:
        return param.detach().clone()
    shards = all_gather_pieces(param.detach(), layout.dim, layout.shard_sizes, group)
    return assemble(shards, layout)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor replaced by its full tensor.

    Collective: every rank of each tensor group must call it. Tied entries stay tied (one
    tensor under both names), like ``state_dict`` itself.
    """
    groups = _tensor_groups(model)
    full: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key not in by_id:
            by_id[key] = gather_full_tensor(tensor, groups.get(key))
        full[name] = by_id[key]
    return full


@torch.no_grad()
def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Copy full tensors into the model, slicing sharded ones for this rank.

    With ``strict``, ``state_dict`` must have exactly the model's keys. No communication.
    """
    own = model.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"load_full_state_dict(strict=True): missing keys {missing[:8]}, unexpected keys "
                f"{unexpected[:8]}; the names must be the unsharded model's own (pass strict=False "
                "to load a subset)."
            )
    groups = _tensor_groups(model)
    for name, target in own.items():
        if name not in state_dict:
            continue
        full = state_dict[name]
        layout: ShardLayout | None = getattr(target, "tp_layout", None)
        if tuple(full.shape) != full_shape(target):
            raise ValueError(
                f"load_full_state_dict: {name} has shape {tuple(full.shape)} but the model's full "
                f"shape is {full_shape(target)}; is the checkpoint from the same configuration?"
            )
        if layout is not None:
            full = slice_shard(full, layout, comm.get_rank(groups.get(id(target))))
        target.copy_(full.to(device=target.device, dtype=target.dtype))
