"""The sharded optimizer with a global gradient norm that spans every pipeline stage.

``ShardedOptimizer`` sums the squared gradient norm over the data-parallel group only.
With pipelining each stage holds different parameters, so the squared norm must also be
summed over the pipe group, and a tied weight held by several stages must be counted
once (its copies on higher stages are *replicated* and skipped). This subclass
overrides ``_global_grad_norm``; everything else (flush, unscale, overflow, clip, step,
all-gather) is the sharding engine's own code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.zero.optimizer import ShardedOptimizer


class PipelineShardedOptimizer(ShardedOptimizer):
    """``ShardedOptimizer`` + ``norm_groups`` (extra groups to sum the squared norm over)
    + ``replicated`` (parameters left out of the norm)."""

    def __init__(
        self,
        *args: Any,
        norm_groups: Sequence[Any] = (),
        replicated: Sequence[nn.Parameter] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.norm_groups = list(norm_groups)
        # (group index, bucket index, lo, hi): slices of master shards to leave out
        self._excluded: list[tuple[int, int, int, int]] = []
        skip = {id(p) for p in replicated}
        for g, group in enumerate(self.groups):
            for i, param in enumerate(group.params):
                if id(param) not in skip:
                    continue
                slot = group.layout.slots[i]
                for b, bucket in enumerate(group.buckets):
                    lo, hi = bucket.shard_range(group.shard_rank)
                    start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                    if start < end:
                        self._excluded.append((g, b, start - lo, end - lo))

    def _local_sq_norm(self) -> torch.Tensor:
        grads = self.master_grads()
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            sq = torch.stack([n.float() for n in norms]).pow(2).sum()
        else:
            device = self.groups[0].device if self.groups else None
            sq = torch.zeros((), dtype=torch.float32, device=device)
        for g, b, lo, hi in self._excluded:
            grad = self.groups[g].masters[b].grad
            if grad is not None:
                sq = sq - grad[lo:hi].float().pow(2).sum().to(sq.device)
        return sq

    def _global_grad_norm(self) -> float:
        sq = self._local_sq_norm()
        if self.stage >= 1 and self.dp_world_size > 1:
            comm.all_reduce(sq, group=self.dp_group)
        for group in self.norm_groups:
            comm.all_reduce(sq, group=group)
        return float(sq.clamp_min(0).sqrt()) if torch.isfinite(sq) else float(sq)
