"""The one flat, padded parameter / gradient / master storage of every ZeRO stage.

A :class:`FlatGroup` packs a list of parameters (one optimizer param group at stages 0-2;
one module unit of one param group at stage 3) into a flat buffer laid out by
:func:`shardspeed.zero.partition.build_layout` in padded buckets, each sharded over
``shard_world_size`` ranks. The stages differ by three policies, chosen at construction:

* **residency** (:mod:`shardspeed.zero.residency`): where the full parameter buffer lives.
  Stages 0-2 keep it whole (parameters are permanent views into it); stage 3 keeps only
  this rank's shard (on the device, in host memory or in an NVMe file) and gathers the
  full buffer around use (``gathered=GatherSpec(...)``, one bucket per flat).
* **gradient storage**: stages 0/1 keep a full flat gradient buffer (``flat_grad``; when
  gradients are kept in the parameter dtype ``param.grad`` is a view into it and autograd
  accumulates in place; otherwise a hook adds each gradient into it). Stages 2/3 keep
  only this rank's slice of every bucket (``shard_grads``), accumulated over the
  micro-steps; full gradients exist only until their bucket is reduce-scattered.
* **masters**: the optimizer updates one *master* tensor per bucket, this rank's slice
  in the master dtype. When the dtypes agree (and nothing is offloaded) the master *is*
  the parameter slice (no copy). With optimizer offload (``offload`` given and
  offloading) the masters are separate host tensors and each bucket has a host gradient
  buffer (``host_grads``) that the reduced gradient slice is copied into for the step.
  The reducer streams that copy (:meth:`FlatGroup.stage_host_grad`) as soon as a
  bucket's last reduction of the accumulation window completes, while backward still
  runs; the optimizer only copies the buckets that were not streamed.

The reducer sees a group through its slots (:mod:`shardspeed.zero.flat_slot`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardspeed.zero.flat_slot import FlatBucket
from shardspeed.zero.init_partition import full_shape, take_full_data
from shardspeed.zero.offload.host import copy_to_host
from shardspeed.zero.params import ZeroParamStatus
from shardspeed.zero.partition import (
    BucketSpec,
    CommSpan,
    FlatLayout,
    build_layout,
    split_for_overlap,
)
from shardspeed.zero.residency import GatheredResidency, WholeResidency

if TYPE_CHECKING:
    from shardspeed.zero.offload import OffloadRuntime


@dataclass(frozen=True)
class GatherSpec:
    """Stage 3: the flat is one module unit's parameters, sharded and gathered around use."""

    dp_group: object | None
    unit_id: int  # -1 for the persistent flat (small parameters kept gathered)
    first_param_id: int  # ds_id of the first parameter
    persistent: bool


class FlatGroup:
    """Parameters packed into padded buckets, sharded over ``shard_world_size`` ranks."""

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
        gathered: GatherSpec | None = None,
    ) -> None:
        self.params = params
        self.offload = offload
        self.shard_rank = shard_rank
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.device = device
        self.unit_id = gathered.unit_id if gathered is not None else -1
        self.persistent = gathered is None or gathered.persistent
        self.label = "group"  # the reducer's tag (stage 3: the unit's name)
        self.group_index = 0  # the optimizer param group (set by the sharding policy)
        # ds_shape of zero.Init-partitioned params; their full data is gathered below
        self.shapes = [full_shape(p) if gathered else p.shape for p in params]
        numels = [shape.numel() for shape in self.shapes]
        if gathered is not None:
            bucket_size = sum(numels) + 1  # never reached: one bucket, one all-gather
        self.layout: FlatLayout = build_layout(numels, bucket_size, shard_world_size)

        # The full buffer, (layout.numel,) in param dtype, params packed at their slots.
        full = torch.zeros(self.layout.numel, dtype=param_dtype, device=device)
        for slot, p in zip(self.layout.slots, params):
            src = take_full_data(p) if gathered else p.detach()
            full[slot.offset : slot.offset + slot.numel].copy_(src.reshape(-1))
        self.residency: WholeResidency | GatheredResidency
        if gathered is None:
            self.residency = WholeResidency(full, self.layout, shard_rank)
            for slot, p in zip(self.layout.slots, params):
                p.data = full[slot.offset : slot.offset + slot.numel].view_as(p)
        else:
            self.residency = GatheredResidency(
                self, params, self.shapes, self.layout, full,
                rank=shard_rank, world=shard_world_size, dp_group=gathered.dp_group,
                device=device, first_param_id=gathered.first_param_id,
                persistent=gathered.persistent, offload=offload,
            )  # fmt: skip
        del full

        # Gradient storage.
        self.grads_are_views = full_grads and grad_dtype == param_dtype and gathered is None
        self.flat_grad: torch.Tensor | None = None
        self.shard_grads: list[torch.Tensor] = []
        if full_grads:
            assert gathered is None, "stage 3 keeps gradient shards only"
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
        alias = param_dtype == master_dtype and not offloaded and self.residency.master_may_alias
        self.masters: list[torch.Tensor] = []
        self.host_grads: list[torch.Tensor] = []  # (shard_numel,) master dtype, with offload
        self.host_grad_staged: list[bool] = []  # host_grads[i] already holds the final grads
        for bucket in self.layout.buckets:
            shard = self.residency.initial_shard(bucket.index)
            if offloaded:
                assert offload is not None
                self.masters.append(offload.new_master(shard, master_dtype))
                self.host_grads.append(offload.new_host_grad(shard.numel(), master_dtype))
                self.host_grad_staged.append(False)
            elif alias:
                self.masters.append(shard)  # the optimizer updates the params in place
            else:
                self.masters.append(shard.to(master_dtype).clone())
        self.masters_alias_params = alias
        if isinstance(self.residency, GatheredResidency):
            self.residency.place()  # the shard moves to its storage; params released

    # -- residency ----------------------------------------------------------------------
    @property
    def buckets(self) -> tuple[BucketSpec, ...]:
        return self.layout.buckets

    @property
    def numel(self) -> int:
        """Padded size of the full buffer."""
        return self.layout.numel

    @property
    def full(self) -> torch.Tensor | None:
        """The full parameter buffer when present (always, at stages 0-2)."""
        return self.residency.full

    @property
    def status(self) -> ZeroParamStatus:
        return self.residency.status

    def start_gather(self) -> None:
        """Launch the all-gather of the full buffer (stage 3; a no-op when whole)."""
        self.residency.start_gather()

    def wait_gather(self) -> None:
        self.residency.wait_gather()

    def gather(self) -> None:
        self.start_gather()
        self.wait_gather()

    def release(self) -> None:
        """Drop the gathered full buffer (stage 3; a no-op when whole)."""
        self.residency.release()

    def is_gathered(self, index: int) -> bool:
        """Bucket ``index``'s parameters are whole on this rank."""
        return self.residency.full is not None

    @torch.no_grad()
    def scatter_full_to_shard(self) -> None:
        """After an in-place edit of the gathered params (stage 3): copy this rank's slice
        into the shard and the master."""
        residency = self.residency
        assert isinstance(residency, GatheredResidency)
        values = residency.gathered_shard()
        residency.write_shard(0, values)
        if self.masters_alias_params:
            return
        if self.offload is not None:
            self.offload.overwrite_master(self.masters[0], values)  # host or NVMe master
        else:
            self.masters[0].copy_(values)

    # -- views ------------------------------------------------------------------------
    @property
    def flat_param(self) -> torch.Tensor:
        """The full parameter buffer of a whole (stage 0-2) group."""
        full = self.residency.full
        assert full is not None, "the parameters are not gathered"
        return full

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
        """Write updated masters into this rank's parameter slices (wherever they live)."""
        if self.masters_alias_params:
            return
        for index in range(len(self.masters)):
            self.copy_master_to_params(index)

    @torch.no_grad()
    def copy_master_to_params(self, index: int) -> None:
        """Write master ``index`` (bucket ``index``) into this rank's parameter slice."""
        if not self.masters_alias_params:
            self.residency.write_shard(index, self.masters[index])

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
        yield self.layout, self.shard_rank, self.params, list(self.shapes), 0

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
        are added into the buffer and dropped. Stages 2/3 keep gradients in ``param.grad``
        until their bucket is packed for its reduction.
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
        them in host memory because of offload (what is swapped to NVMe holds none)."""

        def nbytes(tensors: list[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        grads = nbytes(self.shard_grads) + nbytes(self.host_grads)
        if self.flat_grad is not None:
            grads += nbytes([self.flat_grad])
        masters = 0 if self.masters_alias_params else nbytes(self.masters)
        params = self.residency.storage_bytes()
        host = params["host"] + nbytes(self.host_grads) + (masters if self.host_grads else 0)
        return {
            "params": params["params"],
            "grads": grads,
            "master_params": masters,
            "host": host,
        }
