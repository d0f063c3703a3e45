"""Where offloaded decoder-layer weights live between uses: host memory or NVMe files.

Each layer's parameters and buffers are packed into one flat byte image with the
layout of :func:`plan_layout`::

    layer image (uint8):  | t0 bytes | pad | t1 bytes | pad | ... | t_{n-1} bytes |
                          ^0          ^align           ^align

so one copy moves a whole layer and each tensor is a typed view at its offset.
A store only hands out images (``read``); the device-side ring and the prefetch
order belong to :mod:`~shardspeed.inference.fastgen.offload`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

ALIGN_BYTES = 256  # every tensor starts on a 256-byte boundary (any dtype, any kernel)


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of a layer image: its dtype/shape and byte range."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    def view(self, image: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of ``image`` (a uint8 layer image, host or device)."""
        return image[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def plan_layout(
    specs: list[tuple[tuple[int, ...], torch.dtype]], align: int = ALIGN_BYTES
) -> tuple[list[TensorSlot], int]:
    """Byte offsets of tensors ``(shape, dtype)`` packed in order; returns (slots, image bytes).

    Pure: each tensor starts at a multiple of ``align``; the image size is rounded up
    to ``align`` too, so images of one size can be stacked.
    """
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    slots, offset = [], 0
    for shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        slots.append(TensorSlot(tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // align) * align
    return slots, offset


def pack_image(tensors: list[torch.Tensor], slots: list[TensorSlot], out: torch.Tensor) -> None:
    """Copy ``tensors`` into the uint8 image ``out`` (host) at ``slots``' offsets."""
    for t, slot in zip(tensors, slots):
        slot.view(out).copy_(t.detach())


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host buffer of ``nbytes``, page-locked when ``pin``."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class WeightStore:
    """Holds each layer's image off the compute device; ``read`` returns a host image."""

    kind: str = ""

    def put(self, layer: int, image: torch.Tensor) -> None:
        """Store layer ``layer``'s host image; the store may keep ``image`` itself, so the
        caller must not write to it afterwards."""
        raise NotImplementedError

    def read(self, layer: int, staging: torch.Tensor) -> torch.Tensor:
        """A host uint8 tensor with layer ``layer``'s image: the store's own, or ``staging``
        filled from the store. Callers never write to the returned tensor."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the store holds (files, host memory)."""


class HostStore(WeightStore):
    """One host image per layer (page-locked on CUDA for asynchronous copies)."""

    kind = "cpu"

    def __init__(self, num_layers: int, pin: bool):
        self.pin = pin
        self._images: list[torch.Tensor | None] = [None] * num_layers

    def put(self, layer: int, image: torch.Tensor) -> None:
        if self.pin and not image.is_pinned():  # page-locked for asynchronous H2D copies
            own = host_buffer(image.numel(), pin=True)
            own.copy_(image)
            image = own
        self._images[layer] = image

    def read(self, layer: int, staging: torch.Tensor) -> torch.Tensor:
        image = self._images[layer]
        assert image is not None, f"layer {layer} was never stored"
        return image

    def nbytes(self) -> int:
        return sum(i.numel() for i in self._images if i is not None)

    def close(self) -> None:
        self._images = [None] * len(self._images)


class NvmeStore(WeightStore):
    """One file per layer in a private directory under ``root``; reads go straight into
    a caller's buffer (``os.preadv``), so no whole-model copy is ever held in RAM."""

    kind = "nvme"

    def __init__(self, num_layers: int, root: str | os.PathLike):
        self.directory = Path(tempfile.mkdtemp(prefix="shardspeed-offload-", dir=str(root)))
        self._sizes = [0] * num_layers
        self._fds: list[int | None] = [None] * num_layers
        # Remove the files even if close() is never called (engine garbage-collected).
        self._finalizer = weakref.finalize(self, _remove_files, self._fds, self.directory)

    def _file(self, layer: int) -> Path:
        return self.directory / f"layer_{layer:05d}.bin"

    def put(self, layer: int, image: torch.Tensor) -> None:
        path = self._file(layer)
        with open(path, "wb") as f:
            f.write(memoryview(image.numpy()))
        self._sizes[layer] = image.numel()
        self._fds[layer] = os.open(path, os.O_RDONLY)

    def read(self, layer: int, staging: torch.Tensor) -> torch.Tensor:
        fd, size = self._fds[layer], self._sizes[layer]
        assert fd is not None, f"layer {layer} was never stored"
        view = memoryview(staging[:size].numpy()).cast("B")
        done = 0
        while done < size:  # preadv may return short counts
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise OSError(f"unexpected end of {self._file(layer)} at byte {done} of {size}")
            done += n
        return staging[:size]

    def nbytes(self) -> int:
        return sum(self._sizes)

    def close(self) -> None:
        self._finalizer()


def _remove_files(fds: list[int | None], directory: Path) -> None:
    for i, fd in enumerate(fds):
        if fd is not None:
            os.close(fd)
            fds[i] = None
    shutil.rmtree(directory, ignore_errors=True)
