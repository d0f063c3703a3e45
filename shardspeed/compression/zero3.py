"""Compression under ZeRO stage 3: what ``redundancy_clean`` needs to see whole weights.

During training nothing special is needed: a stage-3 unit gathers its layers' weights and
mask scores before its forward, so in-forward quantization and every mask act on the full
tensors (in-place MoQ quantization is refused by the engine hook). Folding is different:
``redundancy_clean`` replaces weights by smaller ones, which a stage-3 shard layout cannot
hold. So, given a stage-3 engine, :func:`gather_zero3` turns its module back into a plain
model on every rank: all weights are gathered (a collective), each managed parameter is
replaced by a full copy (tied parameters stay tied), and the engine is destroyed so its
gather/release hooks no longer run.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardspeed.zero.init import GatheredParameters
from shardspeed.zero.init_partition import is_init_partitioned
from shardspeed.zero.params import owning_flat

logger = logging.getLogger(__name__)


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 shard (in a stage-3 engine or under ``zero.Init``)."""
    return owning_flat(param) is not None or is_init_partitioned(param)  # type: ignore[arg-type]


def gather_zero3(model: nn.Module) -> bool:
    """Make a stage-3 engine's module whole on every rank and destroy the engine.

    Returns:
        True when ``model`` was a stage-3 engine (its module is now plain), False when its
        parameters were whole already.

    Raises:
        ValueError: partitioned parameters outside an engine (nothing can remove the hooks).
    """
    inner = getattr(model, "module", model)
    managed = [p for p in inner.parameters() if is_partitioned(p)]
    if not managed:
        return False
    if inner is model or not callable(getattr(model, "destroy", None)):
        raise ValueError(
            f"redundancy_clean(model={type(model).__name__}): its parameters are ZeRO-3 "
            "partitioned and it is not the engine, so they cannot be gathered for good; "
            "allowed: the engine returned by shardspeed.initialize, or a model with whole "
            "parameters. Fix: call redundancy_clean(engine, ds_config) on every rank."
        )
    full: dict[int, nn.Parameter] = {}  # id(sharded param) -> its full copy (keeps ties)
    with GatheredParameters(managed):
        for module in inner.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not is_partitioned(param):
                    continue
                if id(param) not in full:
                    data = param.data.detach().clone()
                    full[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
                setattr(module, name, full[id(param)])
    model.destroy()  # type: ignore[operator]
    logger.info("redundancy_clean: gathered %d ZeRO-3 parameters; engine destroyed", len(full))
    return True
