"""Telling expert parameters apart, and DeepSpeed's MoE optimizer param groups.

An expert parameter is one with ``allreduce == False`` (set by
:class:`~shardspeed.parallel.moe.experts.Experts`, with ``group_name = "ep_size_<ep>"``).
:func:`split_params_into_different_moe_groups_for_optimizer` gives the optimizer one
group per (dense group, expert group name), as DeepSpeed's does::

    in:   [{"name": "decay", "params": [w, e0, e1], "weight_decay": 0.1}]
    out:  [{"name": "decay", "params": [w], "weight_decay": 0.1},
           {"name": "ep_size_2", "moe": True, "params": [e0, e1], "weight_decay": 0.1}]

MoE groups hold at most ``max_group_size`` elements each (split in parameter order).
Two deliberate differences from DeepSpeed 0.19.8: MoE groups follow the order expert
group names are first seen (DeepSpeed iterates a ``set``, whose order can differ between
processes), and no empty group is emitted when one parameter exceeds ``max_group_size``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (``param.allreduce`` is set and False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether ``model`` has an MoE layer, the first such layer's ``num_experts`` or 0)."""
    from shardspeed.parallel.moe.layer import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(
    params: list[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense parameters, expert parameters), each in the given order."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: list[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dense gradients, expert gradients), each cast to its parameter's dtype."""
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def _as_group_list(param_groups: Any) -> list[dict[str, Any]]:
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, list):
        return param_groups
    raise ValueError(
        f"split_params_into_different_moe_groups_for_optimizer: param_groups must be a dict, "
        f"a list or a tuple of dicts, got {type(param_groups).__name__}."
    )


def _chunks_by_size(params: list[nn.Parameter], max_size: int | float) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of at most ``max_size`` elements (a bigger one alone)."""
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        if current and size + numel > max_size:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += numel
    if current:
        chunks.append(current)
    return chunks


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | float | None = 178956971,
) -> list[dict[str, Any]]:
    """Move expert parameters out of each group into ``moe: True`` groups named by expert group.

    Each input group keeps its dense parameters (a given list is changed in place and
    returned with the MoE groups appended); each MoE group copies its source group's
    other keys. Groups need a ``"name"`` when they hold expert parameters.
    """
    groups = _as_group_list(param_groups)
    names: dict[str, None] = {}  # expert group names, first-seen order
    for group in groups:
        for p in group["params"]:
            if is_moe_param(p):
                names.setdefault(p.group_name, None)
    moe_groups: dict[tuple[Any, str], dict[str, Any]] = {}
    for group in groups:
        if names and "name" not in group:
            raise ValueError(
                "split_params_into_different_moe_groups_for_optimizer: every param group "
                "needs a 'name' key when the model has expert parameters (e.g. "
                "{'name': 'dense', 'params': ...}); a group without one was given."
            )
        for name in names:
            moe_groups[(group["name"], name)] = {**group, "name": name, "moe": True, "params": []}
    for group in groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                moe_groups[(group["name"], p.group_name)]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for moe_group in moe_groups.values():
        if max_group_size is None:
            groups.append(moe_group)
            continue
        for chunk in _chunks_by_size(moe_group["params"], max_group_size):
            groups.append({**moe_group, "params": chunk})
    return groups


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """True for a group made by :func:`split_params_into_different_moe_groups_for_optimizer`."""
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: list) -> list[dict[str, Any]]:
    """Optimizer groups for a list of parameters or of groups, expert groups split out."""
    if not isinstance(model_parameters, list):
        raise ValueError(
            f"configure_moe_param_groups: model_parameters must be a list, got "
            f"{type(model_parameters).__name__}."
        )
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(
                "configure_moe_param_groups: expected tensors or param-group dicts, got "
                f"{type(p).__name__}."
            )
    first = model_parameters[0]
    if isinstance(first, torch.nn.Parameter):
        group = {"params": model_parameters, "name": "dense-params"}
        return split_params_into_different_moe_groups_for_optimizer(group)
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
