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


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Start copying device tensor ``src`` into host tensor ``dst`` without blocking compute.

    On CUDA the copy runs on a side stream (one per device) that first waits for the work
    already queued on the current stream (the reduction that produced ``src``), so it
    overlaps whatever the current stream does next (the rest of backward). ``src`` must
    stay unmodified until :func:`synchronize`; the gradient shards it is used with are
    persistent and only change after the optimizer step synchronised. On the CPU it is a
    plain copy.
    """
    if src.device.type != "cuda":
        dst.copy_(src)
        return
    index = src.device.index if src.device.index is not None else torch.cuda.current_device()
    stream = _COPY_STREAMS.get(index)
    if stream is None:
        stream = _COPY_STREAMS[index] = torch.cuda.Stream(device=src.device)
    stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=dst.is_pinned())


def synchronize(device: torch.device) -> None:
    """Wait for asynchronous copies to/from ``device``, side streams included (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
