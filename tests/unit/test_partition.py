"""Exhaustive checks of the pure partition math (padding, buckets, shard fragments)."""

from __future__ import annotations

import itertools
import random

import pytest

from shardspeed.zero.partition import (
    build_layout,
    intersect,
    param_shard_fragments,
    round_up,
    shard_range,
)


def test_round_up_and_shard_range() -> None:
    assert [round_up(v, 4) for v in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    assert shard_range(12, 3, 0) == (0, 4)
    assert shard_range(12, 3, 2) == (8, 12)
    with pytest.raises(ValueError, match="not divisible"):
        shard_range(10, 3, 0)
    with pytest.raises(ValueError, match="multiple must be positive"):
        round_up(3, 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bucket_size", [1, 7, 100, 10**9])
def test_layout_invariants(world: int, bucket_size: int) -> None:
    rng = random.Random(world * 1000 + bucket_size)
    for _ in range(20):
        numels = [rng.randint(0, 50) for _ in range(rng.randint(1, 12))]
        layout = build_layout(numels, bucket_size, world)
        # every parameter placed once, inside its bucket, without overlap
        covered = []
        for slot in layout.slots:
            b = layout.buckets[slot.bucket_index]
            assert b.start <= slot.offset and slot.offset + slot.numel <= b.end
            covered.append((slot.offset, slot.offset + slot.numel))
        covered.sort()
        for (_, a1), (b0, _) in itertools.pairwise(covered):
            assert a1 <= b0
        # buckets contiguous, padded to a multiple of world, each non-empty
        start = 0
        for b in layout.buckets:
            assert b.start == start and b.numel % world == 0 and b.numel >= world
            start = b.end
        assert layout.numel == start and layout.shard_numel * world == layout.numel
        # reverse order: the last parameter lands in bucket 0
        assert layout.slots[-1].bucket_index == 0
        # shard fragments of all ranks reassemble every parameter exactly once
        seen = [[0] * n for n in numels]
        for rank in range(world):
            frags = param_shard_fragments(layout, rank)
            for idx, p_start, length, shard_off in frags:
                assert 0 <= shard_off and shard_off + length <= layout.shard_numel
                for e in range(p_start, p_start + length):
                    seen[idx][e] += 1
        assert all(all(c == 1 for c in s) for s in seen)


def test_bucket_closes_at_size() -> None:
    layout = build_layout([10, 10, 10, 10], bucket_size=20, shard_world_size=2)
    assert [b.param_indices for b in layout.buckets] == [(3, 2), (1, 0)]
    big = build_layout([100, 1], bucket_size=10, shard_world_size=4)
    assert [b.param_indices for b in big.buckets] == [(1, 0)]  # closes after reaching size


def test_layout_errors() -> None:
    with pytest.raises(ValueError, match="shard_world_size"):
        build_layout([1], 10, 0)
    with pytest.raises(ValueError, match="bucket_size"):
        build_layout([1], 0, 2)
    with pytest.raises(ValueError, match="non-negative"):
        build_layout([-1], 10, 2)


def test_intersect() -> None:
    assert intersect((0, 5), (3, 9)) == (3, 5)
    assert intersect((0, 3), (3, 9)) is None
