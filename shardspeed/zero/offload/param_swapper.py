"""ZeRO-Infinity parameter offload: stage-3 parameter shards kept in NVMe swap files.

Each stage-3 :class:`~shardspeed.zero.flat_buffer.FlatGroup` registers its shard once (written to
its own file). Before the all-gather, :meth:`ParamSwapper.load` reads the shard into a
pool buffer, copies it to the device and frees the buffer. Reads are prefetched from the
order in which shards were loaded before: loading shard A after shard B last time means
the next load of B starts reading A (and the shards after it, up to
``buffer_count - 1`` reads ahead). After the optimizer step, :meth:`store` writes the
updated shard asynchronously (any prefetched copy of the old values is dropped).

``offload_param.buffer_size`` (elements) bounds the largest shard; the pool holds
``buffer_count`` buffers of ``min(buffer_size, largest shard)`` elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardspeed.config.base import explain
from shardspeed.zero.offload.buffer_pool import BufferPool, PoolExhausted
from shardspeed.zero.offload.file_io import AsyncFileIO, IOHandle
from shardspeed.zero.offload.policy import SwapSettings
from shardspeed.zero.offload.swap_dir import SwapDir


@dataclass
class _ParamSlot:
    index: int
    numel: int
    dtype: torch.dtype
    path: Path
    writes: list[IOHandle] = field(default_factory=list)


class ParamSwapper:
    """Parameter shards in swap files, read through a bounded buffer pool with read-ahead."""

    def __init__(self, settings: SwapSettings, swap_dir: SwapDir, io: AsyncFileIO) -> None:
        assert settings.buffer_size is not None
        self.settings = settings
        self.buffer_size = settings.buffer_size
        self.dir = swap_dir
        self.io = io
        self.slots: list[_ParamSlot] = []
        self._pool: BufferPool | None = None
        self._prefetched: dict[int, tuple[int, IOHandle]] = {}  # slot -> (buffer, read)
        self._next: dict[int, int] = {}  # slot -> the slot loaded after it last time
        self._last: int | None = None
        self.reads_issued = 0
        self.prefetch_hits = 0

    # -- set-up -------------------------------------------------------------------------
    def register(self, shard: torch.Tensor) -> int:
        """Write a shard (contiguous host or device tensor) to its own file; return its id."""
        numel = shard.numel()
        if numel > self.buffer_size:
            key = f"{self.settings.key}.buffer_size"
            raise ValueError(
                explain(
                    f"{key} is smaller than a parameter shard to swap ({numel:,} elements)",
                    self.buffer_size,
                    allowed=f">= {numel:,} (elements, the largest shard on this rank)",
                    fix=f'set "buffer_size": {numel}',
                )
            )
        slot = _ParamSlot(
            len(self.slots), numel, shard.dtype, self.dir.file(f"p{len(self.slots)}.swp")
        )
        data = shard.detach().reshape(-1).to("cpu").contiguous()
        self.io.reserve(slot.path, numel * shard.element_size())
        self.io.write(data, slot.path).wait()
        self.slots.append(slot)
        return slot.index

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            numel = min(self.buffer_size, max(s.numel for s in self.slots))
            elt = max(s.dtype.itemsize for s in self.slots)
            self._pool = BufferPool(
                self.settings.buffer_count, numel * elt, self.settings.pin_memory
            )
        return self._pool

    # -- reads ------------------------------------------------------------------------------
    def _acquire(self) -> int:
        """A pool buffer; drops the oldest prefetched read when every buffer is held by one."""
        try:
            return self.pool.acquire()
        except PoolExhausted:
            if not self._prefetched:
                raise
            self._drop(next(iter(self._prefetched)))
            return self.pool.acquire()

    def _start_read(self, index: int, buffer: int) -> IOHandle:
        slot = self.slots[index]
        for handle in slot.writes:  # read what was last written
            handle.wait()
        slot.writes = []
        self.reads_issued += 1
        return self.io.read(slot.path, self.pool.view(buffer, slot.numel, slot.dtype))

    def _drop(self, index: int) -> None:
        buffer, handle = self._prefetched.pop(index)
        handle.wait()
        self.pool.release(buffer)

    def _read_ahead(self, index: int) -> None:
        """Start reading the shards that followed ``index`` last time, while buffers allow."""
        seen = {index}
        nxt = self._next.get(index)
        while nxt is not None and nxt not in seen:
            seen.add(nxt)
            if len(self._prefetched) >= self.settings.buffer_count - 1:
                return
            if nxt not in self._prefetched:
                got = self.pool.try_acquire(1)
                if got is None:
                    return
                self._prefetched[nxt] = (got[0], self._start_read(nxt, got[0]))
            nxt = self._next.get(nxt)

    def load(self, index: int, device: torch.device) -> torch.Tensor:
        """Shard ``index`` as a new ``(numel,)`` tensor on ``device`` (read-ahead continues)."""
        if self._last is not None and self._last != index:
            self._next[self._last] = index
        self._last = index
        slot = self.slots[index]
        if index in self._prefetched:
            self.prefetch_hits += 1
            buffer, handle = self._prefetched.pop(index)
        else:
            buffer = self._acquire()
            handle = self._start_read(index, buffer)
        self._read_ahead(index)
        handle.wait()
        out = torch.empty(slot.numel, dtype=slot.dtype, device=device)
        out.copy_(self.pool.view(buffer, slot.numel, slot.dtype))  # blocking: the buffer is reused
        self.pool.release(buffer)
        return out

    # -- writes -----------------------------------------------------------------------------
    @torch.no_grad()
    def store(self, index: int, src: torch.Tensor) -> None:
        """Replace shard ``index`` with ``src`` (cast to the shard dtype); written asynchronously."""
        slot = self.slots[index]
        if index in self._prefetched:  # it holds the old values
            self._drop(index)
        for handle in slot.writes:  # one write per file at a time
            handle.wait()
        buffer = self._acquire()
        view = self.pool.view(buffer, slot.numel, slot.dtype)
        view.copy_(src.reshape(-1))
        handle = self.io.write(view, slot.path)
        slot.writes = [handle]
        self.pool.release(buffer, after=handle)

    # -- bookkeeping ------------------------------------------------------------------------
    def drain(self) -> None:
        for index in list(self._prefetched):
            self._drop(index)
        for slot in self.slots:
            for handle in slot.writes:
                handle.wait()
            slot.writes = []
        if self._pool is not None:
            self._pool.drain()

    def storage_bytes(self) -> dict[str, int]:
        files = sum(s.numel * s.dtype.itemsize for s in self.slots)
        pool = self._pool.total_bytes() if self._pool is not None else 0
        return {"swap_buffers": pool, "nvme": files}

    def close(self) -> None:
        self.drain()
