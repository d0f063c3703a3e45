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
fp32. For fp32 training the master *is* a view of ``flat_param`` (no copy).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardspeed.zero.partition import BucketSpec, FlatLayout, build_layout


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
    ) -> None:
        self.params = params
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
        self.masters: list[torch.Tensor] = []
        for bucket in self.layout.buckets:
            shard = self.param_shard(bucket)
            if param_dtype == master_dtype:
                self.masters.append(shard)  # alias: the optimizer updates the params in place
            else:
                self.masters.append(shard.to(master_dtype).clone())
        self.masters_alias_params = param_dtype == master_dtype

    # -- views ------------------------------------------------------------------------
    @property
    def buckets(self) -> tuple[BucketSpec, ...]:
        return self.layout.buckets

    def param_shard(self, bucket: BucketSpec) -> torch.Tensor:
        lo, hi = bucket.shard_range(self.shard_rank)
        return self.flat_param[lo:hi]

    def bucket_params(self, bucket: BucketSpec) -> torch.Tensor:
        return self.flat_param[bucket.start : bucket.end]

    def bucket_grads(self, bucket: BucketSpec) -> torch.Tensor:
        assert self.flat_grad is not None
        return self.flat_grad[bucket.start : bucket.end]

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

    # -- updates ------------------------------------------------------------------------
    def zero_grads(self) -> None:
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            if self.grads_are_views:
                self.attach_grad_views()
        for g in self.shard_grads:
            g.zero_()

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        """Write updated masters back into this rank's slices of ``flat_param``."""
        if self.masters_alias_params:
            return
        for bucket, master in zip(self.buckets, self.masters):
            self.param_shard(bucket).copy_(master)

    @torch.no_grad()
    def pack_bucket_grads(self, bucket: BucketSpec, out: torch.Tensor) -> None:
        """Copy the bucket's ``param.grad`` tensors into ``out`` (zeros where absent)."""
        out.zero_()
        for idx in bucket.param_indices:
            slot = self.layout.slots[idx]
            grad = self.params[idx].grad
            if grad is not None:
                lo = slot.offset - bucket.start
                out[lo : lo + slot.numel].copy_(grad.reshape(-1))

    def release_bucket_grads(self, bucket: BucketSpec) -> None:
        for idx in bucket.param_indices:
            self.params[idx].grad = None

    def storage_bytes(self) -> dict[str, int]:
        """Persistent bytes this group holds, by category."""
        grads = 0
        if self.flat_grad is not None:
            grads += self.flat_grad.numel() * self.flat_grad.element_size()
        grads += sum(g.numel() * g.element_size() for g in self.shard_grads)
        masters = 0
        if not self.masters_alias_params:
            masters = sum(m.numel() * m.element_size() for m in self.masters)
        return {
            "params": self.flat_param.numel() * self.flat_param.element_size(),
            "grads": grads,
            "master_params": masters,
        }
