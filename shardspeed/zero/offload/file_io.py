"""Asynchronous reads and writes of tensor bytes to swap files, in a small thread pool.

Each request is split into ``threads`` contiguous parts (``aio.intra_op_parallelism``),
each part is read or written in ``block_size`` pieces (``aio.block_size``) with
``os.pread``/``os.pwrite`` on its own file descriptor. Those calls release the GIL, so
the I/O overlaps with the optimizer step and with forward/backward. A request returns an
:class:`IOHandle`; ``wait()`` re-raises an I/O error, with "disk full" (``ENOSPC``,
``EDQUOT``) turned into the same actionable error as the up-front free-space check.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

# (path, bytes that were being written) -> the error to raise
NoSpaceError = Callable[[Path, int], Exception]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise AssertionError(f"swap I/O needs a contiguous CPU tensor, got {t.device} {t.stride()}")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _parts(nbytes: int, threads: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) byte ranges, one per thread, each a multiple of ``block`` but the last."""
    if nbytes == 0:
        return []
    per = -(-nbytes // (threads * block)) * block
    return [(lo, min(lo + per, nbytes)) for lo in range(0, nbytes, per)]


def _write_part(path: Path, buf: memoryview, lo: int, hi: int, block: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        pos = lo
        while pos < hi:
            pos += os.pwrite(fd, buf[pos : min(pos + block, hi)], pos)
    finally:
        os.close(fd)


def _read_part(path: Path, buf: memoryview, lo: int, hi: int, block: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = lo
        while pos < hi:
            n = os.preadv(fd, [buf[pos : min(pos + block, hi)]], pos)
            if n == 0:
                raise OSError(errno.EIO, f"swap file {path} ends at byte {pos}, expected {hi}")
            pos += n
    finally:
        os.close(fd)


class IOHandle:
    """One read or write in flight. Keeps the tensor it reads into / writes from alive."""

    def __init__(
        self,
        futures: list[Future[None]],
        path: Path,
        nbytes: int,
        keep: Any,
        no_space: NoSpaceError,
    ) -> None:
        self._futures = futures
        self.path = path
        self.nbytes = nbytes
        self._keep = keep
        self._no_space = no_space

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until the request finished; raise its error, if any."""
        try:
            for f in self._futures:
                f.result()
        except OSError as err:
            if err.errno in NO_SPACE_ERRNOS:
                raise self._no_space(self.path, self.nbytes) from err
            raise
        finally:
            self._keep = None


class AsyncFileIO:
    """A thread pool that moves tensor bytes between host memory and swap files."""

    def __init__(self, threads: int, block_size: int, no_space: NoSpaceError) -> None:
        self.threads = max(1, int(threads))
        self.block_size = max(4096, int(block_size))
        self._no_space = no_space
        # enough workers for a read of the next item while the previous one is written back
        self._pool = ThreadPoolExecutor(max_workers=2 * self.threads, thread_name_prefix="ss-swap")

    def write(self, src: torch.Tensor, path: Path) -> IOHandle:
        """Start writing ``src`` (contiguous, CPU) to ``path`` from byte 0."""
        buf = tensor_bytes(src)
        futures = [
            self._pool.submit(_write_part, path, buf, lo, hi, self.block_size)
            for lo, hi in _parts(len(buf), self.threads, self.block_size)
        ]
        return IOHandle(futures, path, len(buf), (src, buf), self._no_space)

    def read(self, path: Path, out: torch.Tensor) -> IOHandle:
        """Start filling ``out`` (contiguous, CPU) from ``path``."""
        buf = tensor_bytes(out)
        futures = [
            self._pool.submit(_read_part, path, buf, lo, hi, self.block_size)
            for lo, hi in _parts(len(buf), self.threads, self.block_size)
        ]
        return IOHandle(futures, path, len(buf), (out, buf), self._no_space)

    def reserve(self, path: Path, nbytes: int) -> None:
        """Create ``path`` with ``nbytes`` allocated now, so a full disk fails here, not mid-run."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as err:
                if err.errno in NO_SPACE_ERRNOS:
                    raise self._no_space(path, nbytes) from err
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(fd, nbytes)  # the filesystem cannot preallocate: size it sparsely
        finally:
            os.close(fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
