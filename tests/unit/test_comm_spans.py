"""Exhaustive checks of the comm-span split (gradient collectives that overlap backward)."""

from __future__ import annotations

import random

import pytest

from shardspeed.zero.partition import build_layout, split_for_overlap


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_size", [1, 40, 10**9])
@pytest.mark.parametrize("span_size", [1, 7, 60, 10**9])
def test_spans_tile_every_bucket(world: int, bucket_size: int, span_size: int) -> None:
    rng = random.Random(world * 7919 + bucket_size * 31 + span_size)
    for _ in range(20):
        numels = [rng.randint(0, 50) for _ in range(rng.randint(1, 12))]
        layout = build_layout(numels, bucket_size, world)
        first = rng.choice([1, span_size, max(span_size // 3, 1)])
        spans = split_for_overlap(layout, span_size, first)
        assert [s.index for s in spans] == list(range(len(spans)))
        # spans tile the flat buffer: contiguous, inside one bucket each, bucket edges kept
        assert spans[0].start == 0 and spans[-1].end == layout.numel
        for a, b in zip(spans, spans[1:]):
            assert a.end == b.start and a.bucket_index <= b.bucket_index
        for bucket in layout.buckets:
            mine = [s for s in spans if s.bucket_index == bucket.index]
            assert mine[0].start == bucket.start and mine[-1].end == bucket.end
            # the bucket's parameters, in order, split into consecutive spans
            assert [i for s in mine for i in s.param_indices] == list(bucket.param_indices)
        # every parameter lies inside its span
        for span in spans:
            for idx in span.param_indices:
                slot = layout.slots[idx]
                assert span.start <= slot.offset and slot.offset + slot.numel <= span.end
        # a span closes only once full: all but each bucket's last reach their size
        for i, span in enumerate(spans):
            nxt = spans[i + 1] if i + 1 < len(spans) else None
            if nxt is not None and nxt.bucket_index == span.bucket_index:
                size = first if i == 0 else span_size
                assert sum(numels[j] for j in span.param_indices) >= size
                # and not later than needed: without its last parameter it was not full
                assert sum(numels[j] for j in span.param_indices[:-1]) < size


def test_one_span_per_bucket_when_they_fit() -> None:
    layout = build_layout([10, 20, 30, 40], bucket_size=50, shard_world_size=4)
    spans = split_for_overlap(layout, span_size=10**6, first_span_size=10**6)
    assert [(s.start, s.end, s.param_indices) for s in spans] == [
        (b.start, b.end, b.param_indices) for b in layout.buckets
    ]


def test_first_span_small_then_span_size() -> None:
    # reverse order: params 5, 4, ..., 0 of 10 elements each, one bucket of 60 (world 1)
    layout = build_layout([10] * 6, bucket_size=10**9, shard_world_size=1)
    spans = split_for_overlap(layout, span_size=25, first_span_size=5)
    assert [s.param_indices for s in spans] == [(5,), (4, 3, 2), (1, 0)]
    assert [(s.start, s.end) for s in spans] == [(0, 10), (10, 40), (40, 60)]


def test_last_span_keeps_the_bucket_padding() -> None:
    layout = build_layout([3, 3, 3], bucket_size=10**9, shard_world_size=4)  # 9 -> 12
    spans = split_for_overlap(layout, span_size=3, first_span_size=3)
    assert [(s.start, s.end) for s in spans] == [(0, 3), (3, 6), (6, 12)]


def test_span_size_errors() -> None:
    layout = build_layout([4], bucket_size=10, shard_world_size=1)
    with pytest.raises(ValueError, match="span_size=0"):
        split_for_overlap(layout, 0, 1)
