"""User-facing ZeRO-3 helpers: ``GatheredParameters``, external parameters, ``zero.Init``.

``GatheredParameters`` temporarily materialises full parameters outside forward/backward
(to inspect or edit them), both for parameters sharded by the stage-3 engine and for
parameters partitioned by ``zero.Init`` before ``initialize``;
``register_external_parameter`` declares that a module uses a parameter owned by another
module, so stage 3 keeps it gathered whenever that module runs. ``zero.Init`` itself
lives in :mod:`shardspeed.zero.construct`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.utils.logging import warning_once
from shardspeed.zero import init_partition
from shardspeed.zero.construct import Init
from shardspeed.zero.flat_buffer import FlatGroup
from shardspeed.zero.params import ZeroParamStatus, owning_flat

__all__ = [
    "GatheredParameters",
    "Init",
    "gathered_module",
    "register_external_parameter",
    "unregister_external_parameter",
]


def _as_list(params: Any) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, Iterable):
        return list(params)
    raise ValueError(
        f"GatheredParameters(params=...) expects a parameter or an iterable of parameters, "
        f"got {type(params).__name__}; pass e.g. module.parameters()."
    )


class GatheredParameters(contextlib.ContextDecorator):
    """Gather the full data of ZeRO-3 parameters for the duration of the block.

    A collective: every rank of the data-parallel group must enter it with the same
    parameters. With ``modifier_rank`` set, edits made on that rank inside the block are
    broadcast on exit and written into every rank's shard (and fp32 master), or into the
    pieces of a ``zero.Init``-partitioned parameter. Other parameters pass through
    unchanged. ``fwd_module`` is accepted for DeepSpeed compatibility and ignored.
    """

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        flats: dict[int, FlatGroup] = {}
        pieces: dict[int, nn.Parameter] = {}  # zero.Init-partitioned, not yet in an engine
        for p in _as_list(params):
            flat = owning_flat(p)  # type: ignore[arg-type]
            if flat is not None:
                flats.setdefault(id(flat), flat)
            elif init_partition.is_init_partitioned(p):
                pieces.setdefault(id(p), p)  # type: ignore[arg-type]
        self.flats = list(flats.values())
        self.init_params = list(pieces.values())
        self._gathered: list[FlatGroup] = []
        self._gathered_init: list[nn.Parameter] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for flat in self.flats:
            if flat.status is not ZeroParamStatus.AVAILABLE:
                self._gathered.append(flat)
                flat.gather()
        for p in self.init_params:
            if p.ds_status is not ZeroParamStatus.AVAILABLE:  # type: ignore[attr-defined]
                self._gathered_init.append(p)
                init_partition.gather_into_data(p)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc[0] is None:
                for flat in self.flats:
                    assert flat.full is not None
                    group = flat.residency.dp_group  # type: ignore[union-attr]
                    if flat.layout.shard_world_size > 1:
                        src = self.modifier_rank
                        if group is not None:
                            src = torch.distributed.get_global_rank(group, src)
                        comm.broadcast(flat.full, src=src, group=group)
                    flat.scatter_full_to_shard()
                for p in self.init_params:
                    init_partition.scatter_from_data(p, self.modifier_rank)
        finally:
            for flat in self._gathered:
                flat.release()
            for p in self._gathered_init:
                init_partition.release_data(p)
            self._gathered = []
            self._gathered_init = []


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns.

    Call it before ``shardspeed.initialize``: the stage-3 engine then keeps the parameter
    in the root unit, gathered for the whole forward and backward.
    """
    if not isinstance(parameter, nn.Parameter):
        raise ValueError(
            f"register_external_parameter(parameter=...) needs an nn.Parameter, got "
            f"{type(parameter).__name__}."
        )
    if owning_flat(parameter) is not None:
        warning_once(
            "register_external_parameter() called after shardspeed.initialize(): the parameter "
            "is already sharded; register external parameters before initialize()."
        )
    registry = module.__dict__.setdefault("_ss_external_params", {})
    registry[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (before ``shardspeed.initialize``)."""
    registry = module.__dict__.get("_ss_external_params", {})
    if id(parameter) not in registry:
        raise ValueError(
            "unregister_external_parameter(): this parameter was not registered as external "
            f"for module {type(module).__name__}; register it first."
        )
    del registry[id(parameter)]


@contextlib.contextmanager
def gathered_module(module: nn.Module) -> Iterator[nn.Module]:
    """Gather every parameter of ``module`` for the block (read-only convenience)."""
    with GatheredParameters(list(module.parameters())):
        yield module
