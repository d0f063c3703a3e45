"""A tensor-parallel shard's full matrix, rebuilt and cut again (for whole-matrix optimizers).

Muon orthogonalises each weight's update as one matrix; a column- or row-parallel weight
holds only this rank's rows or columns (fused ``[q | k | v]`` pieces included), and the
orthogonal factor of a slice is not the slice of the orthogonal factor. So per step and per
sharded matrix::

    local update (w_r, in)  --all-gather over the tensor group-->  full (out, in)
    full -> Newton-Schulz -> full update -> this rank's slice (the layout's own cut)

:class:`TensorSplit` carries one parameter's :class:`~.partition.ShardLayout`, the tensor
group and this rank's place in it; :func:`tensor_split_of` builds one for a parameter marked
by :func:`~.layers.mark_tensor_parallel` (``None`` for replicated ones). Cost: one all-gather
per sharded matrix and step (each rank receives the other ranks' ``(tp - 1) / tp`` of the
matrix), and every tensor rank computes the full Newton-Schulz (the same numbers on each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed import comm
from shardspeed.parallel.tensor.comm_ops import all_gather_pieces
from shardspeed.parallel.tensor.partition import ShardLayout, assemble, slice_shard


@dataclass(frozen=True)
class TensorSplit:
    """How one parameter is cut over the tensor axis: rebuild (:meth:`full`) and cut
    (:meth:`shard`) its matrices."""

    layout: ShardLayout
    group: Any
    rank: int

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        """The full tensor of ``shard`` (this rank's piece, any dtype): a collective over
        the tensor group, called in the same order on every rank of it."""
        pieces = all_gather_pieces(shard, self.layout.dim, self.layout.shard_sizes, self.group)
        return assemble(pieces, self.layout)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (no communication)."""
        return slice_shard(full, self.layout, self.rank)


def tensor_split_of(param: torch.Tensor, group: Any) -> TensorSplit | None:
    """The split of a tensor-parallel parameter over ``group`` (None: replicated)."""
    layout: ShardLayout | None = getattr(param, "tp_layout", None)
    if not getattr(param, "tensor_model_parallel", False) or layout is None:
        return None
    size = comm.get_world_size(group)
    if layout.tp_size != size:
        raise ValueError(
            f"a tensor-parallel parameter of shape {tuple(param.shape)} is split over "
            f"{layout.tp_size} ranks but the engine's tensor group has {size}. Fix: shard the "
            f'model with the same tensor degree as "tensor_parallel" in the config.'
        )
    return TensorSplit(layout, group, comm.get_rank(group))


def check_same_order(signature: Sequence[Any], group: Any, what: str) -> None:
    """Refuse when the tensor ranks would call :meth:`TensorSplit.full` in different
    orders (``signature``: this rank's calls, e.g. ``(group, master, param)`` per call)."""
    size = comm.get_world_size(group)
    if size <= 1:
        return
    every: list[Any] = [None] * size
    comm.all_gather_object(every, list(signature), group=group)
    if any(s != every[0] for s in every):
        raise ValueError(
            f"{what}: the tensor-parallel ranks hold their sharded matrices in different "
            "places of the flat ZeRO buckets (uneven tensor-parallel widths changed the bucket "
            "boundaries), so their per-matrix all-gathers would not pair up. Fix: use even "
            "tensor-parallel splits, or a zero_optimization.reduce_bucket_size larger than "
            "the model (one bucket)."
        )
