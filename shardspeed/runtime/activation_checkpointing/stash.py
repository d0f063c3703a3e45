"""How a checkpoint keeps its saved inputs until the recompute: whole, partitioned, on host.

``partition_activations``: with a model-parallel group of size MP > 1 every rank holds the
same (replicated) input, so each keeps only its 1/MP slice of the flattened, padded tensor
and the full tensor is all-gathered right before the recompute. ``cpu_checkpointing``: the
kept tensor (or slice) lives in host memory and is copied back to its device on recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardspeed.runtime.activation_checkpointing.config import (
    CheckpointSettings,
    model_parallel_group,
    model_parallel_rank,
    model_parallel_world_size,
)


@dataclass(frozen=True)
class StashedTensor:
    """Metadata needed to rebuild a saved input from what was kept."""

    shape: torch.Size
    numel: int
    device: torch.device
    partitioned: bool  # kept is this rank's slice of the padded flat tensor
    requires_grad: bool


@dataclass(frozen=True)
class StashPolicy:
    """Transforms a saved input into what is kept (``pack``) and back (``unpack``)."""

    partition: bool
    to_cpu: bool
    mp_rank: int = 0
    mp_world_size: int = 1
    group: object = None

    @classmethod
    def from_settings(cls, settings: CheckpointSettings) -> StashPolicy:
        world = model_parallel_world_size() if settings.partition_activations else 1
        return cls(
            partition=settings.partition_activations and world > 1,
            to_cpu=settings.cpu_checkpointing,
            mp_rank=model_parallel_rank(),
            mp_world_size=world,
            group=model_parallel_group() if world > 1 else None,
        )

    @property
    def is_identity(self) -> bool:
        return not self.partition and not self.to_cpu

    def _should_partition(self, tensor: torch.Tensor) -> bool:
        return (
            self.partition and tensor.is_floating_point() and tensor.numel() >= self.mp_world_size
        )

    def pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, StashedTensor]:
        """The tensor to keep and how to rebuild the original from it."""
        meta = StashedTensor(
            shape=tensor.shape,
            numel=tensor.numel(),
            device=tensor.device,
            partitioned=self._should_partition(tensor),
            requires_grad=tensor.requires_grad,
        )
        kept = tensor.detach()
        if meta.partitioned:
            chunk = -(-meta.numel // self.mp_world_size)  # ceil
            flat = kept.reshape(-1)  # (numel,)
            padded = torch.nn.functional.pad(flat, (0, chunk * self.mp_world_size - meta.numel))
            # padded: (MP * chunk,); keep a copy of this rank's (chunk,) slice only
            kept = padded.view(self.mp_world_size, chunk)[self.mp_rank].clone()
        if self.to_cpu:
            pin = kept.device.type == "cuda"
            kept = kept.to("cpu", copy=True)
            if pin:
                kept = kept.pin_memory()
        elif not meta.partitioned:
            kept = tensor  # saved as is; autograd's version check still applies
        return kept, meta

    def unpack(self, kept: torch.Tensor, meta: StashedTensor) -> torch.Tensor:
        """Rebuild the saved input (on its original device) from ``kept``."""
        tensor = kept.to(meta.device, non_blocking=True) if self.to_cpu else kept
        if meta.partitioned:
            slices = [torch.empty_like(tensor) for _ in range(self.mp_world_size)]
            dist.all_gather(slices, tensor.contiguous(), group=self.group)
            flat = torch.cat(slices)  # (MP * chunk,)
            tensor = flat[: meta.numel].view(meta.shape)
        return tensor
