"""Which heads and rows of each weight one tensor-parallel rank holds (pure shard math).

A ragged model built for rank ``r`` of ``T`` keeps a contiguous slice of every
head-parallel and MLP dimension and the whole of everything else::

    qkv_proj   column-parallel  rows  [q heads of r | kv heads of r | kv heads of r]
    o_proj     row-parallel     cols  q heads of r            -> all-reduce
    gate_up    column-parallel  rows  [gate rows of r | up rows of r]
    down_proj  row-parallel     cols  intermediate rows of r  -> all-reduce
    embeddings, norms, router, lm_head: replicated

so each attention block and each MLP ends in one all-reduce. Query heads are
split evenly; KV heads too when ``num_kv_heads >= T``, otherwise each KV head is
replicated on the ``T / num_kv_heads`` ranks whose query heads read it (as vLLM
does), so GQA/MQA models shard without cutting a KV group. A row-parallel bias
lives on rank 0 only (zeros elsewhere): the all-reduce then adds it exactly once.

Nothing here touches ``torch.distributed``: the collective is injected as
:attr:`TensorShard.all_reduce` by :mod:`shardspeed.inference.fastgen.tensor_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HeadShard:
    """Rank-local attention heads: global index ranges and local counts."""

    q_heads: range  # global query heads held by this rank
    kv_heads: range  # global KV heads held by this rank (one replicated head when kv < T)

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _kv_splits(num_kv_heads: int, world_size: int) -> bool:
    """KV heads split evenly, or each replicated on a whole number of ranks."""
    if num_kv_heads >= world_size:
        return num_kv_heads % world_size == 0
    return world_size % num_kv_heads == 0


def shard_heads(
    num_heads: int, num_kv_heads: int, rank: int, world_size: int, model_type: str = "model"
) -> HeadShard:
    """Query/KV heads of ``rank``; ``ValueError`` when the heads cannot be split ``world_size`` ways."""
    valid = [t for t in _divisors(num_heads) if _kv_splits(num_kv_heads, t)]
    if world_size not in valid:
        raise ValueError(
            f"tensor_parallel={world_size} cannot split this {model_type} model's "
            f"num_attention_heads={num_heads} / num_key_value_heads={num_kv_heads}: it must "
            "divide the query heads and either divide the KV heads or be a multiple of them "
            f"(KV heads are then replicated); use tensor_parallel in {valid}."
        )
    q = num_heads // world_size
    if num_kv_heads >= world_size:
        kv = num_kv_heads // world_size
        kv_heads = range(rank * kv, (rank + 1) * kv)
    else:  # replicate: ranks [g * T/G, (g + 1) * T/G) share KV head g
        g = rank * num_kv_heads // world_size
        kv_heads = range(g, g + 1)
    return HeadShard(q_heads=range(rank * q, (rank + 1) * q), kv_heads=kv_heads)


@dataclass(frozen=True)
class TensorShard:
    """This process's place on the tensor axis and the sum over it.

    ``all_reduce`` sums a tensor over the ``world_size`` ranks in place and returns
    it; it is None only when ``world_size == 1``.
    """

    rank: int = 0
    world_size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TensorShard rank={self.rank} must be in [0, {self.world_size}).")
        if self.world_size > 1 and self.all_reduce is None:
            raise ValueError(f"TensorShard(world_size={self.world_size}) needs an all_reduce.")

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs ``x`` (identity when not sharded)."""
        if self.all_reduce is None or not self.sharded:
            return x
        return self.all_reduce(x)

    def heads(self, num_heads: int, num_kv_heads: int, model_type: str = "model") -> HeadShard:
        return shard_heads(num_heads, num_kv_heads, self.rank, self.world_size, model_type)

    def split(self, total: int, name: str, model_type: str = "model") -> range:
        """This rank's contiguous rows of a dim of ``total`` split evenly (``name`` is its config key)."""
        if total % self.world_size:
            raise ValueError(
                f"tensor_parallel={self.world_size} does not divide {name}={total} of this "
                f"{model_type} model; use tensor_parallel in {_divisors(total)}."
            )
        n = total // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)

    def row_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's bias as this rank holds it (rank 0: all of it, others: 0)."""
        return bias if self.rank == 0 else torch.zeros_like(bias)


@dataclass(frozen=True)
class LinearSplit:
    """How one rank holds an ``nn.Linear``: its output rows (``column``) or input columns (``row``).

    ``pieces`` index the whole layer's dim of size ``full``: out features for a
    column-parallel layer, in features for a row-parallel one.
    """

    kind: str  # "column" | "row"
    pieces: tuple[range, ...]
    full: int


def column(pieces: Sequence[range], full: int) -> LinearSplit:
    return LinearSplit("column", tuple(pieces), full)


def row(pieces: Sequence[range], full: int) -> LinearSplit:
    return LinearSplit("row", tuple(pieces), full)


def take(tensor: torch.Tensor, pieces: Sequence[range], full: int, dim: int = 0) -> torch.Tensor:
    """The concatenation of ``tensor``'s index ranges ``pieces`` along ``dim``.

    ``full`` is the size ``dim`` must have; a tensor of another shape is returned
    whole, so the loader's shape check names the checkpoint's real shape.
    """
    if tensor.dim() <= dim or tensor.shape[dim] != full:
        return tensor
    parts = [tensor.narrow(dim, r.start, len(r)) for r in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def head_rows(heads: range, head_dim: int, offset: int = 0) -> range:
    """Rows ``[offset + heads.start * head_dim, offset + heads.stop * head_dim)``."""
    return range(offset + heads.start * head_dim, offset + heads.stop * head_dim)


NO_SHARD = TensorShard()
