"""Per-parameter state of ``zero.Init``: a parameter split into equal pieces over a dp group.

Between its construction under :class:`shardspeed.zero.Init` and ``shardspeed.initialize``
a parameter is *Init-partitioned*: the flattened parameter is zero-padded to a multiple
of the group size and rank ``r`` keeps elements ``[r * k, (r + 1) * k)`` with
``k = ceil(numel / world)`` as ``param.ds_tensor``; ``param.data`` is an empty tensor.
The parameter object itself is unchanged, so ties made by sharing it keep working, and it
carries DeepSpeed's attributes (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_status``,
``ds_tensor``, ``ds_persist``).

Everything that turns pieces back into data is a collective over the Init group:
:func:`gather_full` (all-gather), :func:`take_full_data` (used by the stage-3 engine
while packing a unit's flat buffer), :func:`materialize` (below stage 3), and the
``GatheredParameters`` helpers :func:`gather_into_data` / :func:`scatter_from_data`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

_DS_ATTRS = ("ds_id", "ds_shape", "ds_numel", "ds_status", "ds_tensor", "ds_persist")


@dataclass(frozen=True)
class InitPartition:
    """How one parameter is split: over which group, and where its data lives."""

    group: object | None  # the data-parallel group the pieces are split over (None = world)
    world: int
    rank: int
    comm_device: torch.device  # where collectives on the pieces run (cuda for NCCL)
    init_device: torch.device  # where the parameter was constructed (re-initialisation runs there)
    init_dtype: torch.dtype  # the dtype it was constructed in
    # zero.Init(zero_quantized_weights=True): the engine's stage-3 gathers of this parameter
    # use qwZ even when the config does not set the key (DeepSpeed ORs the two)
    quantized_weights: bool = False

    def piece_numel(self, numel: int) -> int:
        """Elements per rank: ``ceil(numel / world)`` (the last piece is zero-padded)."""
        return max(math.ceil(numel / self.world), 1)

    def src(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` in this partition's group."""
        if self.group is None:
            return group_rank
        return torch.distributed.get_global_rank(self.group, group_rank)


def init_state(param: torch.Tensor) -> InitPartition | None:
    """The :class:`InitPartition` of a ``zero.Init``-partitioned parameter, else None."""
    return getattr(param, "_ss_init", None)


def is_init_partitioned(param: torch.Tensor) -> bool:
    return init_state(param) is not None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's logical shape (``ds_shape`` while Init-partitioned)."""
    return param.ds_shape if is_init_partitioned(param) else param.shape  # type: ignore[attr-defined]


def full_numel(param: torch.Tensor) -> int:
    return full_shape(param).numel()


@torch.no_grad()
def partition_param(
    param: nn.Parameter,
    full: torch.Tensor,
    state: InitPartition,
    *,
    ds_id: int,
    piece_dtype: torch.dtype,
    piece_device: torch.device,
    pin_memory: bool,
    compute_device: torch.device,
) -> None:
    """Keep this rank's piece of ``full`` (identical on every rank) and empty ``param.data``."""
    from shardspeed.zero.params import ZeroParamStatus

    param._ss_init = state  # noqa: SLF001 - marks the parameter as Init-partitioned
    param.ds_shape = full.shape
    param.ds_numel = full.numel()
    param.ds_id = ds_id
    param.ds_persist = False
    param.ds_tensor = _new_piece(state, full.numel(), piece_dtype, piece_device, pin_memory)
    store_full(param, full)
    param.data = torch.empty(0, dtype=piece_dtype, device=compute_device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _new_piece(
    state: InitPartition, numel: int, dtype: torch.dtype, device: torch.device, pin: bool
) -> torch.Tensor:
    pin = pin and device.type == "cpu" and torch.cuda.is_available()
    return torch.zeros(state.piece_numel(numel), dtype=dtype, device=device, pin_memory=pin)


@torch.no_grad()
def store_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` (the whole parameter) into ``param.ds_tensor``."""
    state = init_state(param)
    assert state is not None
    piece: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
    k = piece.numel()
    flat = full.reshape(-1)
    lo = min(state.rank * k, flat.numel())
    hi = min(lo + k, flat.numel())
    piece[: hi - lo].copy_(flat[lo:hi])
    piece[hi - lo :].zero_()


@torch.no_grad()
def gather_full(param: torch.Tensor) -> torch.Tensor:
    """All-gather the pieces (a collective): the parameter in its shape, on the comm device."""
    state = init_state(param)
    assert state is not None
    piece: torch.Tensor = param.ds_tensor.to(state.comm_device)  # type: ignore[attr-defined]
    if state.world == 1:
        flat = piece
    else:
        flat = torch.empty(piece.numel() * state.world, dtype=piece.dtype, device=piece.device)
        comm.all_gather_into_tensor(flat, piece, group=state.group)
    return flat[: param.ds_numel].view(param.ds_shape)  # type: ignore[attr-defined]


def _forget(param: torch.Tensor) -> None:
    """Drop the Init state and DeepSpeed attributes: ``param`` is an ordinary parameter again."""
    for name in ("_ss_init", *_DS_ATTRS):
        if name in param.__dict__:
            delattr(param, name)


def take_full_data(param: torch.Tensor) -> torch.Tensor:
    """The parameter's full data for packing into an engine buffer.

    An ordinary parameter returns ``param.detach()``. An Init-partitioned one is gathered
    from its pieces (a collective over the Init group) and forgets its Init state: its
    pieces are freed once the caller drops the returned tensor.
    """
    if not is_init_partitioned(param):
        return param.detach()
    full = gather_full(param)
    _forget(param)
    return full


@torch.no_grad()
def materialize(param: nn.Parameter) -> None:
    """Gather an Init-partitioned parameter back into ``param.data`` (a collective).

    The result keeps the dtype and device of the current (empty) ``param.data``, so a
    ``module.to(...)`` made after construction still applies.
    """
    target = param.data
    full = gather_full(param)
    _forget(param)
    param.data = full.to(device=target.device, dtype=target.dtype, copy=True)


def materialize_init_params(module: nn.Module, reason: str) -> int:
    """Materialise every Init-partitioned parameter of ``module`` (collective); returns the count.

    Logs a warning naming ``reason`` when there was any: this puts the whole model on
    every rank.
    """
    params = [p for p in _unique_params(module) if is_init_partitioned(p)]
    if not params:
        return 0
    numel = sum(p.ds_numel for p in params)  # type: ignore[attr-defined]
    logger.warning(
        f"{reason}: gathering {len(params)} zero.Init-partitioned parameter(s) "
        f"({numel:,} elements) back to full tensors on every rank; this materialises them "
        "whole on each rank."
    )
    for p in params:
        materialize(p)
    return len(params)


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


# -- GatheredParameters support --------------------------------------------------------------
def gather_into_data(param: nn.Parameter) -> None:
    """Point ``param.data`` at its gathered full tensor (a collective); status AVAILABLE."""
    from shardspeed.zero.params import ZeroParamStatus

    empty = param.data
    param.data = gather_full(param).to(device=empty.device, dtype=empty.dtype, copy=True)
    param.ds_status = ZeroParamStatus.AVAILABLE


@torch.no_grad()
def scatter_from_data(param: nn.Parameter, modifier_rank: int) -> None:
    """Broadcast ``param.data`` from group rank ``modifier_rank``; keep this rank's piece."""
    state = init_state(param)
    assert state is not None
    data = param.data
    if data.shape != param.ds_shape:  # type: ignore[attr-defined]
        raise ValueError(
            f"GatheredParameters: a parameter of shape {tuple(param.ds_shape)} was given data "  # type: ignore[attr-defined]
            f"of shape {tuple(data.shape)} inside the block; keep the shape (edit it in place "
            "or assign a tensor of the same shape)."
        )
    buf = data.to(state.comm_device)
    if state.world > 1:
        comm.broadcast(buf, src=state.src(modifier_rank), group=state.group)
    store_full(param, buf)


def release_data(param: nn.Parameter) -> None:
    """Empty ``param.data`` again after a GatheredParameters block; status NOT_AVAILABLE."""
    from shardspeed.zero.params import ZeroParamStatus

    data = param.data
    param.data = torch.empty(0, dtype=data.dtype, device=data.device)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


# -- torch.nn.init on a partitioned parameter -----------------------------------------------
@torch.no_grad()
def reinitialize(param: nn.Parameter, init_fn: object, args: tuple, kwargs: dict) -> None:
    """Run ``init_fn`` (a ``torch.nn.init`` function) on the full parameter, then re-partition.

    The full tensor is materialised where and in the dtype the parameter was constructed,
    so the random stream (and values) match a construction without ``zero.Init``; rank
    0's result is broadcast so every rank keeps consistent pieces (a collective).
    """
    state = init_state(param)
    assert state is not None
    full = torch.empty(param.ds_shape, dtype=state.init_dtype, device=state.init_device)  # type: ignore[attr-defined]
    init_fn(full, *args, **kwargs)  # type: ignore[operator]
    buf = full.to(state.comm_device)
    if state.world > 1:
        comm.broadcast(buf, src=state.src(0), group=state.group)
    store_full(param, buf)
