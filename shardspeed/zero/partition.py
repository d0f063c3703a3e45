"""Pure partition math for the sharding engine: padding, bucket layout, shard ranges.

Nothing here touches ``torch.distributed``: every function is a plain computation on
integers so it can be tested exhaustively.

Layout of one flat group (the parameters of one optimizer param group, in one dtype)::

    flat buffer:  | bucket 0 (padded)          | bucket 1 (padded)     | ...
    bucket b:     | rank 0 slice | rank 1 slice | ... | rank N-1 slice |
    param p:      lives inside exactly one bucket at [offset, offset + numel)

Each bucket's padded size is a multiple of ``shard_world_size * alignment`` so it can be
reduce-scattered and all-gathered on its own; rank ``r`` owns slice ``r`` of every bucket.
Parameters are placed in reverse registration order because autograd produces gradients
roughly in reverse, so bucket 0 fills first during backward.

A bucket is also the unit of the masters and the optimizer state. The gradients of one
bucket may be reduced in several smaller collectives launched while backward still runs
(:func:`split_for_overlap`): contiguous *comm spans* that tile the bucket, each closed
when it holds about ``span_size`` elements, so the layout (and every checkpoint) does not
depend on how the gradients travel::

    bucket b:     | span 0 (first small) | span 1           | span 2  (+ padding) |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    return -(-value // multiple) * multiple


def shard_range(padded_numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's equal slice of a buffer whose size divides by world_size."""
    if padded_numel % world_size != 0:
        raise ValueError(f"padded_numel {padded_numel} is not divisible by world_size {world_size}")
    size = padded_numel // world_size
    return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its flat group."""

    param_index: int  # index into the group's parameter list
    bucket_index: int
    offset: int  # absolute offset in the flat buffer
    numel: int


@dataclass(frozen=True)
class BucketSpec:
    """One contiguous, padded region of the flat buffer that is reduced as a unit."""

    index: int
    start: int  # absolute offset of the bucket in the flat buffer
    numel: int  # padded size, a multiple of shard_world_size * alignment
    param_indices: tuple[int, ...]
    shard_world_size: int

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shard_world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Absolute [start, end) of ``rank``'s slice of this bucket in the flat buffer."""
        lo, hi = shard_range(self.numel, self.shard_world_size, rank)
        return self.start + lo, self.start + hi


@dataclass(frozen=True)
class FlatLayout:
    """Placement of a group's parameters into padded buckets."""

    slots: tuple[ParamSlot, ...]  # indexed by param_index
    buckets: tuple[BucketSpec, ...]
    shard_world_size: int

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shard_world_size

    def shard_offset(self, bucket_index: int) -> int:
        """Offset of a bucket's slice inside a rank's concatenated shard."""
        return self.buckets[bucket_index].start // self.shard_world_size


def build_layout(
    numels: Sequence[int], bucket_size: int, shard_world_size: int, alignment: int = 1
) -> FlatLayout:
    """Assign parameters (by index, in reverse order) to buckets of about ``bucket_size``.

    A bucket closes once it holds at least ``bucket_size`` elements; a parameter larger
    than ``bucket_size`` gets a bucket of its own. Every bucket is padded to a multiple of
    ``shard_world_size * alignment``.
    """
    if shard_world_size < 1:
        raise ValueError(f"shard_world_size must be >= 1, got {shard_world_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 element, got {bucket_size}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be non-negative, got {list(numels)}")
    quantum = shard_world_size * max(alignment, 1)
    order = list(range(len(numels)))[::-1]

    groups: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for idx in order:
        current.append(idx)
        current_numel += numels[idx]
        if current_numel >= bucket_size:
            groups.append(current)
            current, current_numel = [], 0
    if current:
        groups.append(current)

    slots: dict[int, ParamSlot] = {}
    buckets: list[BucketSpec] = []
    start = 0
    for b, members in enumerate(groups):
        offset = start
        for idx in members:
            slots[idx] = ParamSlot(idx, b, offset, numels[idx])
            offset += numels[idx]
        padded = max(round_up(offset - start, quantum), quantum)
        buckets.append(BucketSpec(b, start, padded, tuple(members), shard_world_size))
        start += padded
    return FlatLayout(tuple(slots[i] for i in range(len(numels))), tuple(buckets), shard_world_size)


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """Overlap of two half-open ranges, or None."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def param_shard_fragments(layout: FlatLayout, rank: int) -> list[tuple[int, int, int, int]]:
    """The pieces of each parameter that ``rank`` owns.

    Returns ``(param_index, param_start, length, shard_offset)`` tuples: elements
    ``[param_start, param_start + length)`` of the flattened parameter live at
    ``shard_offset`` in the rank's concatenated shard.
    """
    frags = []
    for slot in layout.slots:
        bucket = layout.buckets[slot.bucket_index]
        owned = bucket.shard_range(rank)
        hit = intersect((slot.offset, slot.offset + slot.numel), owned)
        if hit is None:
            continue
        shard_offset = layout.shard_offset(bucket.index) + (hit[0] - owned[0])
        frags.append((slot.param_index, hit[0] - slot.offset, hit[1] - hit[0], shard_offset))
    return frags


@dataclass(frozen=True)
class CommSpan:
    """A contiguous part of one bucket whose gradients are reduced by one collective."""

    index: int  # launch rank within the group: spans of bucket 0 first
    bucket_index: int  # the layout bucket it belongs to
    start: int  # absolute offset in the flat buffer
    end: int
    param_indices: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


def split_for_overlap(layout: FlatLayout, span_size: int, first_span_size: int) -> list[CommSpan]:
    """Tile every bucket of ``layout`` with comm spans of about ``span_size`` elements.

    Walks each bucket's parameters in layout order (reverse registration, the order their
    gradients become ready) and closes a span once it holds at least its size; the
    group's very first span closes at ``first_span_size`` instead, so the first collective
    starts early in backward (DDP's small first bucket). A parameter larger than the size
    gets a span of its own. Spans never cross a bucket boundary and together cover every
    element of the flat buffer: a bucket's first span starts at the bucket's start and its
    last span runs to the bucket's end (padding included). A bucket that fits in one span
    gives exactly one span equal to the bucket.
    """
    if span_size < 1 or first_span_size < 1:
        raise ValueError(
            f"comm span sizes must be >= 1 element, got span_size={span_size}, "
            f"first_span_size={first_span_size}"
        )
    spans: list[CommSpan] = []
    for bucket in layout.buckets:
        parts: list[list[int]] = []  # parameter indices of each span of this bucket
        filled = 0  # elements in parts[-1]
        for idx in bucket.param_indices:
            group_first = not spans and len(parts) == 1
            if not parts or filled >= (first_span_size if group_first else span_size):
                parts.append([])
                filled = 0
            parts[-1].append(idx)
            filled += layout.slots[idx].numel
        if not parts:  # a bucket without parameters is still one span (its padding)
            parts.append([])
        starts = [bucket.start] + [layout.slots[part[0]].offset for part in parts[1:]]
        ends = [*starts[1:], bucket.end]
        for part, start, end in zip(parts, starts, ends):
            spans.append(CommSpan(len(spans), bucket.index, start, end, tuple(part)))
    return spans
