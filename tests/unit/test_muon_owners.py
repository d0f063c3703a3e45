"""The owner exchange's plan (``shardspeed.ops.muon_owners``), every rank in one process.

A simulated all-to-all moves each rank's ``send`` pieces to their owners; every matrix
must arrive whole at exactly one owner that holds a piece of it, and the reverse exchange
must put each orthogonalised element back where it came from.
"""

from __future__ import annotations

import pytest
import torch

from shardspeed.ops.muon_owners import BucketMatrix, assign_owners, plan_exchange


def _bucket(sizes: list[int], world: int) -> tuple[list[BucketMatrix], int]:
    """Matrices packed from offset 0, the bucket padded to a multiple of ``world``."""
    matrices, offset = [], 0
    for n in sizes:
        matrices.append(BucketMatrix(offset, n))
        offset += n
    return matrices, -(-offset // world)


def _all_to_all(sends: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """``recv[d]``: the pieces every source sent to ``d``, in source order."""
    pieces = [list(s.split(sp)) for s, sp in zip(sends, splits)]
    return [torch.cat([pieces[s][d] for s in range(len(sends))]) for d in range(len(sends))]


@pytest.mark.parametrize(
    "sizes, world",
    [([12, 30, 7, 50], 2), ([12, 30, 7, 50], 3), ([100], 4), ([3, 3, 3, 3, 3], 4), ([5], 1)],
)
def test_every_matrix_arrives_whole_at_one_owner_and_returns(sizes: list[int], world: int) -> None:
    matrices, shard = _bucket(sizes, world)
    bucket = torch.arange(world * shard, dtype=torch.float32)  # element = its bucket position
    owners = assign_owners(matrices, shard, world, [0] * world)
    plans = [plan_exchange(matrices, owners, shard, world, r) for r in range(world)]
    for m, owner in zip(matrices, owners):  # the owner holds a piece of its matrix
        assert m.offset < (owner + 1) * shard and owner * shard < m.offset + m.numel
    shards = list(bucket.view(world, shard))
    recv = _all_to_all(
        [s[p.send_index] for s, p in zip(shards, plans)], [p.send_splits for p in plans]
    )
    seen = []
    results = []
    for r, (plan, got) in enumerate(zip(plans, recv)):
        assert plan.recv_splits == [plans[s].send_splits[r] for s in range(world)]
        owned = torch.empty(sum(n for _, _, n in plan.owned))
        owned.index_copy_(0, plan.assemble_positions, got)
        for j, base, numel in plan.owned:
            m = matrices[j]
            expected = torch.arange(m.offset, m.offset + m.numel, dtype=torch.float32)
            torch.testing.assert_close(owned[base : base + numel], expected, rtol=0, atol=0)
            seen.append(j)
        results.append((-owned)[plan.assemble_positions])  # "orthogonalise": negate
    assert sorted(seen) == list(range(len(matrices)))  # each matrix owned exactly once
    back = _all_to_all(results, [p.recv_splits for p in plans])
    for r, (plan, got) in enumerate(zip(plans, back)):
        out = torch.zeros(shard).index_copy_(0, plan.send_index, got)
        covered = torch.zeros(shard, dtype=torch.bool)
        covered[plan.send_index] = True
        torch.testing.assert_close(out[covered], -shards[r][covered], rtol=0, atol=0)
        assert int(covered.sum()) == sum(  # every matrix element of my slice, padding not
            max(0, min(m.offset + m.numel, (r + 1) * shard) - max(m.offset, r * shard))
            for m in matrices
        )


def test_owners_balance_elements() -> None:
    """Eight equal matrices inside one rank's slice each: two per rank of four."""
    matrices, shard = _bucket([10] * 8, 4)
    owners = assign_owners(matrices, shard, 4, [0] * 4)
    assert owners == [0, 0, 1, 1, 2, 2, 3, 3]
    loads = [0] * 2  # a matrix held by both ranks goes to the less loaded one
    matrices, shard = _bucket([6, 8, 6], 2)  # slices [0, 10) and [10, 20)
    assert assign_owners(matrices, shard, 2, loads) == [0, 1, 1]
    assert loads == [6, 14]
