"""Flat, padded parameter and gradient storage for one optimizer param group.

Every trainable parameter of the group becomes a view into one flat buffer
(``flat_param``), laid out by :func:`shardspeed.zero.partition.build_layout`. The
gradient storage depends on the sharding stage:

* stages 0/1 keep a full flat gradient buffer. When gradients are kept in the parameter
  dtype, ``param.grad`` is a view into it and autograd accumulates in place (no copy);
  otherwise (fp32 accumulation of 16-bit gradients) a hook adds each gradient into it.
* stage 2 keeps only this rank's slice of every bucket (``shard_grads``); full gradients
  exist only transiently until their bucket is reduce-scattered.

The optimizer updates one *master* tensor per bucket: this rank's slice of the bucket in
fp32. For fp32 training the master *is* a view of ``flat_param`` (no copy). With
optimizer offload (``offload`` given and offloading) the masters are separate host
tensors and each bucket has a host gradient buffer (``host_grads``) that the reduced
gradient slice is copied into for the step. The reducer streams that copy
(:meth:`FlatGroup.stage_host_grad`) as soon as a bucket's last reduction of the
accumulation window completes, while backward still runs; the optimizer only copies the
buckets that were not streamed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardspeed.zero.offload.host import copy_to_host
from shardspeed.zero.partition import (
    BucketSpec,
    CommSpan,
    FlatLayout,
    build_layout,
    intersect,
    split_for_overlap,
)

if TYPE_CHECKING:
    from shardspeed.zero.offload import OffloadRuntime


class FlatGroup:
    """One optimizer param group packed into padded buckets, sharded over ``shard_world_size``."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        shard_world_size: int,
        shard_rank: int,
        bucket_size: int,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        master_dtype: torch.dtype,
        full_grads: bool,
        device: torch.device,
        offload: OffloadRuntime | None = None,
    ) -> None:
        self.params = params
        self.offload = offload
        self.shard_rank = shard_rank
        self.layout: FlatLayout = build_layout(
            [p.numel() for p in params], bucket_size, shard_world_size
        )
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.device = device

        # flat_param: (layout.numel,) in param dtype; params become views into it.
        self.flat_param = torch.zeros(self.layout.numel, dtype=param_dtype, device=device)
        for slot, p in zip(self.layout.slots, params):
            view = self.flat_param[slot.offset : slot.offset + slot.numel].view_as(p)
            view.copy_(p.detach())
            p.data = view

        # Gradient storage.
        self.grads_are_views = full_grads and grad_dtype == param_dtype
        self.flat_grad: torch.Tensor | None = None
        self.shard_grads: list[torch.Tensor] = []
        if full_grads:
            self.flat_grad = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
            if self.grads_are_views:
                self.attach_grad_views()
        else:
            self.shard_grads = [
                torch.zeros(b.shard_numel, dtype=grad_dtype, device=device)
                for b in self.layout.buckets
            ]

        # Masters: this rank's slice of every bucket, in master dtype.
        offloaded = offload is not None and offload.offload_optimizer
        self.masters: list[torch.Tensor] = []
        self.host_grads: list[torch.Tensor] = []  # (shard_numel,) master dtype, with offload
        self.host_grad_staged: list[bool] = []  # host_grads[i] already holds the final grads
        for bucket in self.layout.buckets:
            shard = self.param_shard(bucket)
            if offloaded:
                assert offload is not None
                self.masters.append(offload.new_master(shard, master_dtype))
                self.host_grads.append(offload.new_host_grad(shard.numel(), master_dtype))
                self.host_grad_staged.append(False)
            elif param_dtype == master_dtype:
                self.masters.append(shard)  # alias: the optimizer updates the params in place
            else:
                self.masters.append(shard.to(master_dtype).clone())
        self.masters_alias_params = param_dtype == master_dtype and not offloaded

    # -- views ------------------------------------------------------------------------
    @property
    def buckets(self) -> tuple[BucketSpec, ...]:
        return self.layout.buckets

    def param_shard(self, bucket: BucketSpec) -> torch.Tensor:
        lo, hi = bucket.shard_range(self.shard_rank)
        return self.flat_param[lo:hi]

    def bucket_params(self, bucket: BucketSpec) -> torch.Tensor:
        return self.flat_param[bucket.start : bucket.end]

    def span_grads(self, span: CommSpan | BucketSpec) -> torch.Tensor:
        """``flat_grad`` over a bucket or a part of one (stages 0/1)."""
        assert self.flat_grad is not None
        return self.flat_grad[span.start : span.end]

    def grad_view(self, param_index: int) -> torch.Tensor:
        assert self.flat_grad is not None
        slot = self.layout.slots[param_index]
        return self.flat_grad[slot.offset : slot.offset + slot.numel].view_as(
            self.params[param_index]
        )

    def attach_grad_views(self) -> None:
        """(Re)point every ``param.grad`` at its slice of ``flat_grad``."""
        for i, p in enumerate(self.params):
            p.grad = self.grad_view(i)

    def shard_grad(self, bucket: BucketSpec) -> torch.Tensor:
        """This rank's reduced gradient slice of ``bucket``."""
        if self.flat_grad is not None:
            lo, hi = bucket.shard_range(self.shard_rank)
            return self.flat_grad[lo:hi]
        return self.shard_grads[bucket.index]

    def stage_host_grad(self, bucket: BucketSpec) -> None:
        """Start the device -> host copy of the bucket's final (reduced) gradient slice.

        Called by the reducer when the bucket's last reduction of the accumulation window
        has completed; the copy is asynchronous on CUDA and the optimizer synchronises the
        device before reading it. A no-op without optimizer offload.
        """
        if self.host_grads:
            copy_to_host(self.host_grads[bucket.index], self.shard_grad(bucket))
            self.host_grad_staged[bucket.index] = True

    def optimizer_grad(self, bucket: BucketSpec) -> torch.Tensor:
        """The gradient the optimizer reads: the shard itself, or (offload) its host copy,
        started now unless the reducer already streamed it during backward."""
        if not self.host_grads:
            return self.shard_grad(bucket)
        if not self.host_grad_staged[bucket.index]:
            self.stage_host_grad(bucket)
        return self.host_grads[bucket.index]

    # -- updates ------------------------------------------------------------------------
    def zero_grads(self) -> None:
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            if self.grads_are_views:
                self.attach_grad_views()
        for g in self.shard_grads:
            g.zero_()
        self.host_grad_staged = [False] * len(self.host_grads)

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """Write updated masters back into this rank's slices of ``flat_param``."""
        if self.masters_alias_params:
            return
        for index in range(len(self.masters)):
            self.copy_master_to_params(index)

    @torch.no_grad()
    def copy_master_to_params(self, index: int) -> None:
        """Write master ``index`` (bucket ``index``) into this rank's slice of ``flat_param``."""
        if not self.masters_alias_params:
            self.param_shard(self.buckets[index]).copy_(self.masters[index])

    @torch.no_grad()
    def pack_grads(self, span: CommSpan | BucketSpec, out: torch.Tensor) -> None:
        """Copy the ``param.grad`` tensors of ``span`` (a bucket or a part of one) into
        ``out``, ``(span.numel,)`` (zeros where absent)."""
        out.zero_()
        for idx in span.param_indices:
            slot = self.layout.slots[idx]
            grad = self.params[idx].grad
            if grad is not None:
                lo = slot.offset - span.start
                out[lo : lo + slot.numel].copy_(grad.reshape(-1))

    def release_grads(self, span: CommSpan | BucketSpec) -> None:
        for idx in span.param_indices:
            self.params[idx].grad = None

    def layouts(self) -> Iterator[tuple[FlatLayout, int, list[nn.Parameter], list, int]]:
        """The one layout of this group (see :func:`shardspeed.zero.fragments.param_fragments`)."""
        yield self.layout, self.shard_rank, self.params, [p.shape for p in self.params], 0

    def is_gathered(self, index: int) -> bool:
        """Bucket ``index``'s parameters are whole on this rank (always, at stages 0-2)."""
        return True

    def grad_slots(
        self, group_index: int, span_size: int = 0, first_span_size: int = 0
    ) -> list[FlatBucket]:
        """The reducer's slots (see :class:`shardspeed.zero.reducer.GradSlot`): one per
        bucket, or with ``span_size`` > 0 one per comm span of about that many elements
        (:func:`~shardspeed.zero.partition.split_for_overlap`; the first closes at
        ``first_span_size``), so reductions start while backward runs. Spans smaller than
        a bucket are all-reduced: callers split only where the collective is an all-reduce
        anyway (stage 0, or a backend that scatters via all-reduce) and never with
        optimizer offload, whose host copies go per bucket."""
        if span_size <= 0:
            spans = [
                CommSpan(b.index, b.index, b.start, b.end, b.param_indices) for b in self.buckets
            ]
        else:
            assert not self.host_grads, "offloaded gradients are streamed per whole bucket"
            spans = split_for_overlap(self.layout, span_size, first_span_size or span_size)
        return [FlatBucket(self, span, group_index) for span in spans]

    def accumulate_grad(self, param_index: int) -> None:
        """Grad hook, stages 0/1: make sure ``param.grad`` landed in the flat buffer.

        With views, autograd accumulates in place unless someone replaced ``.grad`` (e.g.
        ``zero_grad(set_to_none=True)``); 16-bit gradients accumulated in a wider dtype
        are added into the buffer and dropped.
        """
        if self.flat_grad is None:
            return
        param = self.params[param_index]
        view = self.grad_view(param_index)
        if self.grads_are_views:
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.add_(param.grad)
                param.grad = view
        elif param.grad is not None:
            view.add_(param.grad)
            param.grad = None

    def storage_bytes(self) -> dict[str, int]:
        """Persistent bytes this group holds in memory, by category; ``host`` is the part of
        them that optimizer offload keeps in host memory (masters swapped to NVMe hold none)."""

        def nbytes(tensors: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        grads = nbytes(self.shard_grads) + nbytes(self.host_grads)
        if self.flat_grad is not None:
            grads += nbytes([self.flat_grad])
        masters = 0 if self.masters_alias_params else nbytes(self.masters)
        host = nbytes(self.host_grads) + (masters if self.host_grads else 0)
        return {
            "params": nbytes([self.flat_param]),
            "grads": grads,
            "master_params": masters,
            "host": host,
        }


class FlatBucket:
    """One comm span of a :class:`FlatGroup` (a whole bucket, or a part of one) as a
    reducer slot.

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
