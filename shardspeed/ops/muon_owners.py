"""Whole matrices from sharded flat buckets: one owner rank per matrix (Muon at ZeRO 1-3).

A bucket of ``N * S`` elements is sharded over ``N`` ranks, rank ``r`` holding elements
``[r S, (r + 1) S)``; a matrix at ``[b, b + n)`` may straddle several slices. Every matrix
gets one *owner* among the ranks holding a piece of it (greedy: the least-loaded such
rank by elements, the lowest on a tie, loads carried across buckets), the same on every
rank because every rank plans from the same list. Per step and bucket::

    send = shard[send_index]                   # my pieces, grouped by owner, matrix order
    all_to_all(send -> recv)                   # each owner receives its matrices' pieces
    owned = recv placed at assemble_positions  # owned matrices, whole, concatenated
    O = NS(matrix) for each owned matrix       # once per matrix, on its owner
    all_to_all(O pieces -> back)               # the reverse exchange
    out[send_index] = back                     # my slice of every orthogonalised matrix

Bytes per rank per step: about ``S (N-1)/N`` elements sent each way (less what it owns of
its own slice), against ``S (N-1)`` received by an all-gather of the bucket; equal at
``N = 2``, ``N / 2`` times fewer above. :func:`plan_exchange` is pure (no communication),
so the plan is unit-tested for every rank in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BucketMatrix:
    """A matrix of the bucket: elements ``[offset, offset + numel)`` of the whole bucket."""

    offset: int
    numel: int


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's part in one bucket's owner exchange (see the module docstring)."""

    send_index: Tensor  # (sum(send_splits),) int64 positions in this rank's shard
    send_splits: list[int]  # per destination rank
    recv_splits: list[int]  # per source rank
    assemble_positions: Tensor  # (sum(recv_splits),) int64: where recv[k] goes in owned
    owned: list[tuple[int, int, int]]  # (matrix index, offset in owned, numel)
    owners: list[int]  # per matrix of the bucket


def _piece(m: BucketMatrix, rank: int, shard_numel: int) -> tuple[int, int] | None:
    """``(start in the matrix, length)`` of ``m`` inside ``rank``'s slice, or None."""
    lo = max(m.offset, rank * shard_numel)
    hi = min(m.offset + m.numel, (rank + 1) * shard_numel)
    return (lo - m.offset, hi - lo) if hi > lo else None


def assign_owners(
    matrices: Sequence[BucketMatrix], shard_numel: int, world: int, loads: list[int]
) -> list[int]:
    """Per matrix, the least-loaded rank holding a piece of it (``loads`` updated)."""
    owners = []
    for m in matrices:
        holders = [r for r in range(world) if _piece(m, r, shard_numel) is not None]
        assert holders, f"matrix {m} lies outside the bucket of {world} x {shard_numel}"
        owner = min(holders, key=lambda r: (loads[r], r))
        loads[owner] += m.numel
        owners.append(owner)
    return owners


def plan_exchange(
    matrices: Sequence[BucketMatrix], owners: Sequence[int], shard_numel: int, world: int, rank: int
) -> ExchangePlan:
    """``rank``'s index maps for one bucket (``matrices`` in bucket order, their owners)."""
    send_index: list[Tensor] = []
    send_splits = []
    for dest in range(world):  # my pieces, grouped by owner, in matrix order
        count = 0
        for m, owner in zip(matrices, owners):
            piece = _piece(m, rank, shard_numel) if owner == dest else None
            if piece is not None:
                local = m.offset + piece[0] - rank * shard_numel
                send_index.append(torch.arange(local, local + piece[1]))
                count += piece[1]
        send_splits.append(count)
    owned, cursor = [], 0
    for j, (m, owner) in enumerate(zip(matrices, owners)):
        if owner == rank:
            owned.append((j, cursor, m.numel))
            cursor += m.numel
    positions: list[Tensor] = []
    recv_splits = []
    for source in range(world):  # what each source sends me, in the order it sends it
        count = 0
        for j, base, _ in owned:
            piece = _piece(matrices[j], source, shard_numel)
            if piece is not None:
                positions.append(torch.arange(base + piece[0], base + piece[0] + piece[1]))
                count += piece[1]
        recv_splits.append(count)
    empty = torch.zeros(0, dtype=torch.int64)
    return ExchangePlan(
        torch.cat(send_index) if send_index else empty,
        send_splits,
        recv_splits,
        torch.cat(positions) if positions else empty,
        owned,
        list(owners),
    )


def exchange(
    plan: ExchangePlan,
    shard: Tensor,
    group: object,
    orthogonalise: Callable[[int, Tensor], Tensor],
) -> Tensor:
    """This rank's slice of every orthogonalised matrix of the bucket (zeros elsewhere).

    ``shard``: ``(S,)`` this rank's elements of the update; ``orthogonalise(j, flat)``
    returns matrix ``j``'s orthogonalised update, flat, from its whole flat update.
    Two all-to-alls over ``group`` (every rank of it calls this, in the same order).
    """
    from shardspeed import comm

    send_index = plan.send_index.to(shard.device)
    positions = plan.assemble_positions.to(shard.device)
    send = shard.index_select(0, send_index)  # (sum(send_splits),)
    recv = shard.new_empty(sum(plan.recv_splits))
    comm.all_to_all_single(recv, send, plan.recv_splits, plan.send_splits, group=group)
    total = sum(n for _, _, n in plan.owned)
    owned = shard.new_empty(total).index_copy_(0, positions, recv)  # (owned numel,)
    result = torch.empty_like(owned)
    for j, base, numel in plan.owned:
        result.narrow(0, base, numel).copy_(orthogonalise(j, owned.narrow(0, base, numel)))
    back = shard.new_empty(send.numel())
    comm.all_to_all_single(
        back, result.index_select(0, positions), plan.send_splits, plan.recv_splits, group=group
    )
    return torch.zeros_like(shard).index_copy_(0, send_index, back)
