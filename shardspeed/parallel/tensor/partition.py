"""Pure shard math for tensor parallelism: how one dim of a weight is cut over the tensor axis.

Nothing here touches ``torch.distributed``; the split rules are integer functions and the
slicing helpers are plain tensor ops, so every case can be unit-tested in one process.

A split dim may hold several fused sub-parameters (GPT-2's ``c_attn`` output is
``[q | k | v]``). Each sub-parameter is cut on its own and rank ``r`` holds its piece of every
sub-parameter, concatenated in sub-parameter order::

    full dim (sub_sizes = (E, E, E), tp = 2):   | q0  q1 | k0  k1 | v0  v1 |
    rank 0 shard:                               | q0 | k0 | v0 |          widths[s][0]
    rank 1 shard:                               | q1 | k1 | v1 |          widths[s][1]

A plain layer is the one-sub-parameter case. Widths may be uneven (and even zero), as
DeepSpeed AutoTP's are: KV-head groups are never cut, the rest is split near-evenly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def even_split(total: int, tp_size: int, grain: int = 1) -> tuple[int, ...]:
    """Near-even widths of ``total`` over ``tp_size`` ranks, in multiples of ``grain``.

    The first ``(total // grain) % tp_size`` ranks get one grain more; a tail shorter than a
    grain goes to the last rank (DeepSpeed's ``tp_grain_size`` rule). ``grain`` larger than
    ``total`` falls back to a split by elements.
    """
    _check_positive("tp_size", tp_size)
    _check_positive("grain", grain)
    if total < 0:
        raise ValueError(f"even_split: total must be >= 0, got {total}")
    if total < grain:
        grain = 1
    num_grains, tail = divmod(total, grain)
    widths = [(num_grains // tp_size + (r < num_grains % tp_size)) * grain for r in range(tp_size)]
    widths[-1] += tail
    return tuple(widths)


def group_split(total: int, tp_size: int, num_groups: int) -> tuple[int, ...]:
    """Widths of ``total`` over ``tp_size`` ranks without cutting any of ``num_groups`` groups.

    ``total`` is ``num_groups`` equal groups (KV heads with their query heads); rank ``r``
    gets ``num_groups // tp_size`` groups, one more for the first ``num_groups % tp_size``.
    """
    _check_positive("tp_size", tp_size)
    _check_positive("num_groups", num_groups)
    if total % num_groups:
        raise ValueError(f"group_split: total {total} is not a multiple of num_groups {num_groups}")
    group_width = total // num_groups
    return tuple(
        (num_groups // tp_size + (r < num_groups % tp_size)) * group_width for r in range(tp_size)
    )


def autotp_split(
    total: int, tp_size: int, *, num_kv_heads: int | None, head_aligned: bool, grain: int = 1
) -> tuple[int, ...]:
    """DeepSpeed AutoTP's widths for one dim of ``total`` (``tp_shard.get_shard_size``).

    Attention-like dims (``head_aligned``) whose size is a multiple of ``num_kv_heads`` keep
    whole KV-head groups per rank; everything else is split near-evenly in ``grain`` units.
    """
    if head_aligned and num_kv_heads and total % num_kv_heads == 0:
        return group_split(total, tp_size, num_kv_heads)
    return even_split(total, tp_size, grain)


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor-axis rank's shard of one parameter (or activation) dim comes from.

    ``dim`` is the split dim of the full tensor; ``sub_sizes`` the fused sub-parameters along
    it (one entry for a plain layer); ``widths[s][r]`` rank ``r``'s width of sub-parameter ``s``.
    """

    dim: int
    sub_sizes: tuple[int, ...]
    widths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        assert self.sub_sizes and len(self.widths) == len(self.sub_sizes), self
        tp_sizes = {len(w) for w in self.widths}
        assert len(tp_sizes) == 1, f"every sub-parameter needs one width per rank: {self}"
        for size, per_rank in zip(self.sub_sizes, self.widths):
            assert sum(per_rank) == size and min(per_rank) >= 0, f"widths must tile: {self}"

    @classmethod
    def of(cls, dim: int, widths: Sequence[int]) -> ShardLayout:
        """A plain (single sub-parameter) layout from per-rank widths."""
        return cls(dim, (sum(widths),), (tuple(widths),))

    @classmethod
    def fused(cls, dim: int, widths_per_sub: Sequence[Sequence[int]]) -> ShardLayout:
        """A layout of fused sub-parameters, each with its own per-rank widths."""
        widths = tuple(tuple(w) for w in widths_per_sub)
        return cls(dim, tuple(sum(w) for w in widths), widths)

    @property
    def tp_size(self) -> int:
        return len(self.widths[0])

    @property
    def full_size(self) -> int:
        return sum(self.sub_sizes)

    @property
    def num_sub(self) -> int:
        """Megatron's ``partition_stride``: how many fused pieces one shard concatenates."""
        return len(self.sub_sizes)

    def shard_size(self, rank: int) -> int:
        return sum(w[rank] for w in self.widths)

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return tuple(self.shard_size(r) for r in range(self.tp_size))

    def ranges(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` in the full dim of each piece of ``rank``'s shard, in shard order."""
        pieces = []
        base = 0
        for size, per_rank in zip(self.sub_sizes, self.widths):
            start = base + sum(per_rank[:rank])
            pieces.append((start, start + per_rank[rank]))
            base += size
        return tuple(pieces)

    def with_dim(self, dim: int) -> ShardLayout:
        """The same split applied to another dim (a bias, or an activation's last dim)."""
        return ShardLayout(dim, self.sub_sizes, self.widths)


def slice_shard(full: torch.Tensor, layout: ShardLayout, rank: int) -> torch.Tensor:
    """``rank``'s shard of ``full`` (a new contiguous tensor)."""
    _check_full(full, layout)
    pieces = [full.narrow(layout.dim, lo, hi - lo) for lo, hi in layout.ranges(rank)]
    return torch.cat(pieces, dim=layout.dim).contiguous() if len(pieces) > 1 else pieces[0].clone()


def assemble(shards: Sequence[torch.Tensor], layout: ShardLayout) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order), undoing :func:`slice_shard`."""
    assert len(shards) == layout.tp_size, (len(shards), layout)
    dim = layout.dim
    # pieces[s][r]: sub-parameter s as held by rank r
    pieces: list[list[torch.Tensor]] = [[] for _ in layout.sub_sizes]
    for rank, shard in enumerate(shards):
        assert shard.shape[dim] == layout.shard_size(rank), (tuple(shard.shape), rank, layout)
        offset = 0
        for s, per_rank in enumerate(layout.widths):
            pieces[s].append(shard.narrow(dim, offset, per_rank[rank]))
            offset += per_rank[rank]
    return torch.cat([p for sub in pieces for p in sub], dim=dim)


def _check_full(full: torch.Tensor, layout: ShardLayout) -> None:
    if full.shape[layout.dim] != layout.full_size:
        raise ValueError(
            f"tensor of shape {tuple(full.shape)} has {full.shape[layout.dim]} elements along dim "
            f"{layout.dim}, but its tensor-parallel layout expects {layout.full_size}; load the "
            "full (unsharded) tensor of the same model configuration."
        )


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
