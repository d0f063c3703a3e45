"""A bounded pool of host staging buffers for NVMe swapping.

``count`` byte buffers of ``nbytes`` each are allocated once (pinned when CUDA is
present). A buffer is *free*, *held* by its user, or *draining*: released with the write
that still reads from it, and free again once that write has finished. ``acquire`` waits
for the oldest draining buffer when none is free; it never allocates beyond ``count``.
"""

from __future__ import annotations

from collections import deque

import torch

from shardspeed.zero.offload.file_io import IOHandle
from shardspeed.zero.offload.host import can_pin


class PoolExhausted(RuntimeError):
    """Every buffer is held by its user: the caller asked for more than the pool holds."""


class BufferPool:
    """``count`` reusable host buffers of ``nbytes`` bytes each."""

    def __init__(self, count: int, nbytes: int, pin_memory: bool) -> None:
        if count < 1 or nbytes < 1:
            raise AssertionError(
                f"BufferPool needs count >= 1 and nbytes >= 1, got {count}, {nbytes}"
            )
        self.count = count
        self.nbytes = nbytes
        pin = can_pin(pin_memory)
        self._buffers = [
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(count)
        ]
        self._free: list[int] = list(range(count))
        self._draining: deque[tuple[int, IOHandle]] = deque()
        self._held: set[int] = set()

    # -- bookkeeping ----------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_free(self) -> int:
        self._collect()
        return len(self._free)

    def total_bytes(self) -> int:
        return self.count * self.nbytes

    def _collect(self) -> None:
        """Move draining buffers whose write has finished back to the free list."""
        still = deque()
        while self._draining:
            idx, handle = self._draining.popleft()
            if handle.done():
                handle.wait()  # surface a write error now
                self._free.append(idx)
            else:
                still.append((idx, handle))
        self._draining = still

    # -- acquire / release ----------------------------------------------------------------
    def acquire(self) -> int:
        """A buffer index, waiting for the oldest write-back if none is free."""
        self._collect()
        if not self._free:
            if not self._draining:
                raise PoolExhausted(
                    f"all {self.count} swap buffers are held; release one before acquiring"
                )
            idx, handle = self._draining.popleft()
            handle.wait()
            self._free.append(idx)
        idx = self._free.pop()
        self._held.add(idx)
        return idx

    def try_acquire(self, n: int) -> list[int] | None:
        """``n`` buffers if that many are free right now (no waiting), else None."""
        self._collect()
        if len(self._free) < n:
            return None
        return [self.acquire() for _ in range(n)]

    def release(self, idx: int, after: IOHandle | None = None) -> None:
        """Give a buffer back; with ``after``, only once that write (reading it) finished."""
        self._held.remove(idx)
        if after is None:
            self._free.append(idx)
        else:
            self._draining.append((idx, after))

    def drain(self) -> None:
        """Wait for every pending write-back."""
        while self._draining:
            idx, handle = self._draining.popleft()
            handle.wait()
            self._free.append(idx)

    def view(self, idx: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``numel`` elements of buffer ``idx`` as a ``(numel,)`` tensor of ``dtype``."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.nbytes:
            raise AssertionError(f"{nbytes} bytes do not fit a {self.nbytes}-byte swap buffer")
        return self._buffers[idx][:nbytes].view(dtype)
