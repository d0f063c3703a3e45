"""Accelerator abstraction: which device and collective backend this process uses.

A small, DeepSpeed-compatible subset (``get_accelerator().device_name()`` etc.).
CUDA is used when present; otherwise the CPU with the gloo backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Accelerator:
    """The device family this process computes on."""

    name: str  # "cuda" or "cpu"

    def device_name(self, index: int | None = None) -> str:
        if self.name == "cpu" or index is None:
            return self.name
        return f"{self.name}:{index}"

    def current_device_name(self) -> str:
        if self.name == "cuda":
            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        if self.name == "cuda":
            return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())

    def communication_backend_name(self) -> str:
        return "nccl" if self.name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return self.name == "cpu" or torch.cuda.is_available()

    def is_bf16_supported(self) -> bool:
        if self.name == "cuda":
            return torch.cuda.is_bf16_supported()
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.name == "cuda":
            torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.name == "cuda" else 0

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated() if self.name == "cuda" else 0

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.name == "cuda" else tensor


def get_accelerator() -> Accelerator:
    """The accelerator for this process; ``SHARDSPEED_ACCELERATOR=cpu|cuda`` overrides."""
    forced = os.environ.get("SHARDSPEED_ACCELERATOR") or os.environ.get("DS_ACCELERATOR")
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ValueError(
                f"SHARDSPEED_ACCELERATOR={forced!r} is not supported; use 'cpu' or 'cuda'."
            )
        return Accelerator(forced)
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")
