"""Autograd functions that move activations on and off the tensor axis (Megatron's mappings).

Each op is a pair of collectives, one in forward and its adjoint in backward:

=================================  ==========================  ==========================
op                                 forward                     backward
=================================  ==========================  ==========================
``copy_to_tensor_region``          identity                    all-reduce
``reduce_from_tensor_region``      all-reduce                  identity
``scatter_to_tensor_region``       keep this rank's features   all-gather features
``gather_from_tensor_region``      all-gather features         keep this rank's features
``scatter_to_sequence_region``     keep this rank's tokens     all-gather tokens
``gather_from_sequence_region``    all-gather tokens           reduce-scatter (or keep)
``reduce_scatter_to_sequence_...`` reduce-scatter tokens       all-gather tokens
=================================  ==========================  ==========================

Features are the last dim, split by a :class:`~.partition.ShardLayout` (uneven and fused
splits allowed); tokens are ``seq_dim``, split evenly (the sequence length must divide by
the tensor size). On a group of one rank every op is the identity.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm
from shardspeed.parallel.tensor.partition import ShardLayout, assemble


def _size(group: Any) -> int:
    return comm.get_world_size(group)


def _all_reduce_(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.contiguous()
    comm.all_reduce(out, group=group)
    return out


def all_gather_pieces(
    x: torch.Tensor, dim: int, sizes: tuple[int, ...], group: Any
) -> list[torch.Tensor]:
    """Every rank's ``x`` (width ``sizes[r]`` along ``dim``, may differ), in rank order.

    Equal widths gather straight into a ``(ranks, *x.shape)`` buffer (contiguous pieces,
    so the caller's ``cat`` is a plain copy); uneven widths are zero-padded to the widest so
    one flat all-gather serves every rank.
    """
    if all(w == sizes[0] for w in sizes):
        flat = x.new_empty((len(sizes) * x.shape[0], *x.shape[1:]))
        comm.all_gather_into_tensor(flat, x.contiguous(), group=group)
        return list(flat.view(len(sizes), *x.shape).unbind(0))
    front = x.movedim(dim, 0)  # (w_r, ...)
    width = max(sizes)
    padded = front.new_zeros((width, *front.shape[1:]))
    padded[: front.shape[0]].copy_(front)
    buffer = front.new_empty((len(sizes) * width, *front.shape[1:]))
    comm.all_gather_into_tensor(buffer, padded, group=group)
    return [buffer[r * width : r * width + w].movedim(0, dim) for r, w in enumerate(sizes)]


def _local_features(x: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    pieces = [x.narrow(-1, lo, hi - lo) for lo, hi in layout.ranges(rank)]
    return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0].contiguous()


def _check_sequence(x: torch.Tensor, seq_dim: int, tp: int) -> None:
    if x.shape[seq_dim] % tp:
        raise ValueError(
            f"sequence parallelism splits dim {seq_dim} of an activation of shape {tuple(x.shape)} "
            f"over {tp} tensor ranks, which needs a multiple of {tp}; pad the sequence length."
        )


# ----------------------------------------------------------------- tensor axis (features)
class _CopyToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce_(grad, ctx.group), None


class _ReduceFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous()
        if out is x:
            ctx.mark_dirty(x)  # reduced in place: a fresh activation nobody else saved
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, layout: ShardLayout) -> torch.Tensor:
        ctx.group, ctx.layout = group, layout
        return _local_features(x, layout, comm.get_rank(group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout = ctx.layout.with_dim(grad.dim() - 1)
        pieces = all_gather_pieces(grad, grad.dim() - 1, layout.shard_sizes, ctx.group)
        return assemble(pieces, layout), None, None


class _GatherFromTensorRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, layout: ShardLayout) -> torch.Tensor:
        ctx.group, ctx.layout = group, layout
        layout = layout.with_dim(x.dim() - 1)
        return assemble(all_gather_pieces(x, x.dim() - 1, layout.shard_sizes, group), layout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _local_features(grad, ctx.layout, comm.get_rank(ctx.group)), None, None


def copy_to_tensor_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce the gradient."""
    return x if _size(group) == 1 else _CopyToTensorRegion.apply(x, group)


def reduce_from_tensor_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a region of partial sums: all-reduce forward, identity backward."""
    return x if _size(group) == 1 else _ReduceFromTensorRegion.apply(x, group)


def scatter_to_tensor_region(x: torch.Tensor, group: Any, layout: ShardLayout) -> torch.Tensor:
    """Keep this rank's features (last dim, by ``layout``); all-gather the gradient."""
    return x if _size(group) == 1 else _ScatterToTensorRegion.apply(x, group, layout)


def gather_from_tensor_region(x: torch.Tensor, group: Any, layout: ShardLayout) -> torch.Tensor:
    """All-gather every rank's features into the full last dim; keep this rank's gradient."""
    return x if _size(group) == 1 else _GatherFromTensorRegion.apply(x, group, layout)


# ----------------------------------------------------------------- sequence parallel (tokens)
def _gather_tokens(x: torch.Tensor, seq_dim: int, group: Any) -> torch.Tensor:
    tp = _size(group)
    return torch.cat(all_gather_pieces(x, seq_dim, (x.shape[seq_dim],) * tp, group), dim=seq_dim)


def _reduce_scatter_tokens(x: torch.Tensor, seq_dim: int, group: Any) -> torch.Tensor:
    tp = _size(group)
    _check_sequence(x, seq_dim, tp)
    front = x.movedim(seq_dim, 0).contiguous()  # (T, ...)
    out = front.new_empty((front.shape[0] // tp, *front.shape[1:]))  # (T / tp, ...)
    comm.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, seq_dim)


def _local_tokens(x: torch.Tensor, seq_dim: int, group: Any) -> torch.Tensor:
    tp = _size(group)
    _check_sequence(x, seq_dim, tp)
    return x.chunk(tp, dim=seq_dim)[comm.get_rank(group)].contiguous()


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, seq_dim: int) -> torch.Tensor:
        ctx.group, ctx.seq_dim = group, seq_dim
        return _local_tokens(x, seq_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_tokens(grad, ctx.seq_dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: Any, seq_dim: int, reduce_grads: bool
    ) -> torch.Tensor:
        ctx.group, ctx.seq_dim, ctx.reduce_grads = group, seq_dim, reduce_grads
        return _gather_tokens(x, seq_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grads:  # the gathered tokens fed partial-sum (column-parallel) compute
            return _reduce_scatter_tokens(grad, ctx.seq_dim, ctx.group), None, None, None
        return _local_tokens(grad, ctx.seq_dim, ctx.group), None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, seq_dim: int) -> torch.Tensor:
        ctx.group, ctx.seq_dim = group, seq_dim
        return _reduce_scatter_tokens(x, seq_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_tokens(grad, ctx.seq_dim, ctx.group), None, None


def scatter_to_sequence_region(x: torch.Tensor, group: Any, seq_dim: int = 1) -> torch.Tensor:
    """Keep this rank's tokens (an even chunk of ``seq_dim``); all-gather the gradient."""
    return x if _size(group) == 1 else _ScatterToSequenceRegion.apply(x, group, seq_dim)


def gather_from_sequence_region(
    x: torch.Tensor, group: Any, seq_dim: int = 1, reduce_grads: bool = True
) -> torch.Tensor:
    """All-gather the tokens; backward reduce-scatters (``reduce_grads``) or keeps this chunk."""
    if _size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, seq_dim, reduce_grads)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor, group: Any, seq_dim: int = 1
) -> torch.Tensor:
    """Sum partial results and keep this rank's tokens; all-gather the gradient."""
    return x if _size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group, seq_dim)
