"""A flat group's gradients as the reducer's slots (:class:`shardspeed.zero.reducer.GradSlot`).

A slot is one collective's worth of gradients: a whole bucket of a
:class:`~shardspeed.zero.flat_buffer.FlatGroup` (every stage; at stage 3 a unit's flat is
one bucket), or with comm spans a part of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardspeed.zero.partition import CommSpan, intersect

if TYPE_CHECKING:
    from shardspeed.zero.flat_buffer import FlatGroup


class FlatBucket:
    """One comm span of a :class:`~shardspeed.zero.flat_buffer.FlatGroup` (a whole
    bucket, or a part of one) as a reducer slot.

    A whole bucket of a sharded group is reduce-scattered (or all-reduced and sliced) and
    keeps this rank's slice. A part of a bucket has no rank slice of its own, so it reports
    no ``owned_range`` (the reduction is an all-reduce) and keeps its overlap with this
    rank's slice itself in :meth:`store`.
    """

    def __init__(self, group: FlatGroup, span: CommSpan, group_index: int) -> None:
        self.group = group
        self.span = span
        self.bucket = group.buckets[span.bucket_index]
        self.params = [group.params[i] for i in span.param_indices]
        self._index = {id(p): i for p, i in zip(self.params, span.param_indices)}
        self.whole = (span.start, span.end) == (self.bucket.start, self.bucket.end)
        self.streams_to_host = bool(group.host_grads) and self.whole
        self.group_index = group_index
        if group.residency.around_use:  # stage 3: one slot per unit flat
            self.label = group.label
        else:
            self.label = f"group {group_index} bucket {self.bucket.index}"
        if not self.whole:
            self.label += f" span {span.index}"
        self._sharded = group.layout.shard_world_size > 1
        # this rank's absolute [lo, hi) of the bucket (the whole bucket when unsharded)
        self._owned = self.bucket.shard_range(group.shard_rank)

    def describe(self) -> str:
        return self.label

    def owned_range(self) -> tuple[int, int] | None:
        if not (self._sharded and self.whole):
            return None
        lo, hi = self._owned
        return lo - self.span.start, hi - self.span.start

    def on_grad(self, param: nn.Parameter) -> None:
        self.group.accumulate_grad(self._index[id(param)])

    def reduce_input(self, dtype: torch.dtype) -> torch.Tensor:
        group, span = self.group, self.span
        if group.flat_grad is not None:  # stages 0/1: reduce the full buffer in place
            src = group.span_grads(span)
            return src if src.dtype == dtype else src.to(dtype)
        buf = torch.empty(span.numel, dtype=dtype, device=group.device)  # (span.numel,)
        group.pack_grads(span, buf)
        group.release_grads(span)
        return buf

    def store(self, reduced: torch.Tensor) -> None:
        # reduced: this rank's slice when owned_range() is given, else the whole span
        lo, hi = self._owned if self.owned_range() is not None else (self.span.start, self.span.end)
        group = self.group
        if group.flat_grad is not None:  # stages 0/1: the reduced gradients stay in place
            dst = group.flat_grad[lo:hi]
            if dst.data_ptr() != reduced.data_ptr():
                dst.copy_(reduced)
            return
        # stage 2: accumulate this rank's part across micro-steps
        hit = intersect((lo, hi), self._owned)
        if hit is not None:
            own_lo = self._owned[0]
            dst = group.shard_grads[self.bucket.index][hit[0] - own_lo : hit[1] - own_lo]
            dst.add_(reduced[hit[0] - lo : hit[1] - lo])

    def stage_host_grad(self) -> None:
        self.group.stage_host_grad(self.bucket)
