"""Engine set-up helpers: collect parameter groups, build the optimizer over master shards.

Kept apart from ``engine.py`` so the engine reads as orchestration only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

OptimizerLike = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None


def collect_param_groups(
    module: nn.Module, optimizer: OptimizerLike, model_parameters: Iterable[Any] | None
) -> list[dict[str, Any]]:
    """The parameter groups to shard: from a client optimizer, ``model_parameters`` or the module.

    Each group is a dict with ``params`` (deduplicated, trainable only) and the group's
    hyperparameters. Tied parameters appear once, in the first group that lists them. Groups
    left empty (none given, or frozen-only, as the Hugging Face Trainer's no-decay group of a
    LoRA fine-tune) are kept, as DeepSpeed keeps them: the optimizer and LR scheduler see the
    same number of groups the caller built.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        raw = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            raw = [dict(g) for g in items]
        else:
            raw = [{"params": items}]
    else:
        raw = [{"params": list(module.parameters())}]

    seen: set[int] = set()
    groups = []
    for g in raw:
        params = g["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        unique = []
        for p in params:
            if not isinstance(p, nn.Parameter):
                raise ValueError(
                    f"model_parameters/optimizer param groups must hold nn.Parameter objects "
                    f"of the model, got {type(p).__name__}; pass model.parameters()."
                )
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            unique.append(p)
        groups.append({**g, "params": unique})
    module_params = {id(p) for p in module.parameters()}
    foreign = [p for g in groups for p in g["params"] if id(p) not in module_params]
    if foreign:
        raise ValueError(
            f"{len(foreign)} parameter(s) given to the optimizer are not parameters of the "
            "model passed to initialize(); pass the model's own parameters."
        )
    if not any(g["params"] for g in groups):
        raise ValueError(
            "initialize() found no trainable parameter: every parameter given (model_parameters, "
            "the optimizer's param groups or the model's) has requires_grad=False. Fix: unfreeze "
            "the parameters to train, or pass the model without an optimizer for inference."
        )
    return groups


def rebind_optimizer(
    optimizer: OptimizerLike,
    config_optimizer: Any,
    groups: list[dict[str, Any]],
    master_params: list[list[torch.Tensor]],
    *,
    offload: bool = False,
) -> torch.optim.Optimizer | None:
    """Return a torch optimizer whose groups hold the master shards instead of the params.

    * a client optimizer instance is reused: its ``param_groups[i]['params']`` become the
      masters of group ``i`` (hyperparameters, and any scheduler bound to it, are kept);
    * a callable is called with the master groups;
    * otherwise the config's ``optimizer`` block builds one; with ``offload`` (the masters
      live on the host: ``offload_optimizer``) it is DeepSpeed's CPU class for the type,
      e.g. :class:`~shardspeed.ops.adam.DeepSpeedCPUAdam` for Adam/AdamW unless
      ``torch_adam`` is set, as in DeepSpeed.
    """
    master_groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": m}
        for g, m in zip(groups, master_params)
    ]
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != len(groups):  # internal: groups come from it
            raise AssertionError(
                f"{len(groups)} groups for {len(optimizer.param_groups)} optimizer groups"
            )
        if optimizer.state:
            raise ValueError(
                "the client optimizer already has state (it has been stepped); pass a fresh "
                "optimizer to initialize() and load state through the engine's checkpoints."
            )
        for pg, m in zip(optimizer.param_groups, master_params):
            pg["params"] = m
        return optimizer
    if callable(optimizer):
        return optimizer(master_groups)
    if config_optimizer is not None:
        from shardspeed.optim import build_optimizer

        return build_optimizer(
            config_optimizer.type, dict(config_optimizer.params), master_groups, offload=offload
        )
    return None


def cast_module(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move the module to ``device`` and cast floating parameters and buffers to ``dtype``."""
    module.to(device=device)
    if dtype != torch.float32:
        module.to(dtype=dtype)
