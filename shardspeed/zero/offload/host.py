"""Host (CPU) memory for offloaded state: pinned allocation and device synchronisation."""

from __future__ import annotations

import torch


def can_pin(pin_memory: bool) -> bool:
    """Page-locked memory only helps (and only works) with a CUDA device present."""
    return pin_memory and torch.cuda.is_available()


def host_zeros(numel: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A zeroed host tensor of ``(numel,)``, pinned when asked and an accelerator exists."""
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=can_pin(pin_memory))


def host_copy(src: torch.Tensor, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A separate host tensor holding ``src`` (flattened) in ``dtype``; never an alias."""
    out = torch.empty(src.numel(), dtype=dtype, device="cpu", pin_memory=can_pin(pin_memory))
    out.copy_(src.reshape(-1))
    return out


def synchronize(device: torch.device) -> None:
    """Wait for asynchronous copies to/from ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
