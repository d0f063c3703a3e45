"""The exchange's collectives on the engine's private group (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardspeed.inference.fastgen.tensor_parallel.errors import TensorParallelError
from shardspeed.inference.fastgen.tensor_parallel.group import GroupHandle


class GroupComm:
    """:class:`~.dispatch.ExpertComm` over a :class:`GroupHandle` (connected after load)."""

    def __init__(self, handle: GroupHandle, world_size: int) -> None:
        self.handle = handle
        self.world_size = world_size

    def _group(self):  # noqa: ANN202 - a ProcessGroup backend object
        if self.handle.group is None:
            raise TensorParallelError(
                "expert-parallel exchange before the group was connected (internal error)."
            )
        return self.handle.group

    def all_to_all(
        self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        opts = dist.AllToAllOptions()
        self._group().alltoall_base(out, x.contiguous(), output_splits, input_splits, opts).wait()
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._group().allgather([parts], [x.contiguous()]).wait()
        return parts
