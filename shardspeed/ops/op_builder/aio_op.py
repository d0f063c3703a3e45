"""The ``async_io`` op (``AsyncIOBuilder().load()``): DeepSpeed's ``aio_handle``, ShardSpeed I/O.

``aio_handle`` reads and writes whole CPU tensors from and to files through
:class:`shardspeed.zero.offload.file_io.AsyncFileIO`, the thread pool behind ShardSpeed's
NVMe offload: each request is split into ``intra_op_parallelism`` parts moved in
``block_size`` pieces with ``pread``/``pwrite``, which release the GIL. ``async_*``
requests return at once; ``wait()`` blocks until they are done and returns their count,
as DeepSpeed's handle does. ``queue_depth``, ``single_submit`` and ``overlap_events`` tune
libaio in DeepSpeed; they are kept and reported but change nothing here.

Limits: buffers must be contiguous CPU tensors and ``file_offset`` must be 0 (each
request covers a file from its first byte).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import torch

from shardspeed.zero.offload.file_io import AsyncFileIO, IOHandle


def _no_space(path: Path, nbytes: int) -> Exception:
    return OSError(
        errno.ENOSPC,
        f"no space left writing {nbytes} bytes to {path}; free disk space or point the "
        "swap files at a larger volume",
    )


class aio_handle:  # noqa: N801 - DeepSpeed's name
    """A handle for whole-tensor file reads and writes, synchronous or asynchronous."""

    def __init__(
        self,
        block_size: int = 1024 * 1024,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("queue_depth", queue_depth),
            ("intra_op_parallelism", intra_op_parallelism),
        ):
            if int(value) < 1:
                raise ValueError(f"aio_handle {name} must be a positive integer, got {value!r}.")
        self._block_size = int(block_size)
        self._queue_depth = int(queue_depth)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        self._intra_op_parallelism = int(intra_op_parallelism)
        self._io = AsyncFileIO(self._intra_op_parallelism, self._block_size, _no_space)
        self._pending: list[IOHandle] = []

    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._intra_op_parallelism

    # ------------------------------------------------------------------ requests
    def _start(self, write: bool, buffer: torch.Tensor, filename: Any, offset: int) -> IOHandle:
        if not isinstance(filename, (str, os.PathLike)):
            raise ValueError(
                f"aio_handle: filename must be a path, got {type(filename).__name__}; "
                "pass the file's path (file descriptors are not supported)."
            )
        if int(offset) != 0:
            raise ValueError(
                f"aio_handle: file_offset={offset} is not supported; ShardSpeed's swap I/O "
                "reads and writes a file from byte 0. Use one file per tensor."
            )
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(
                f"aio_handle: buffer must be a contiguous CPU tensor, got device "
                f"{buffer.device} contiguous={buffer.is_contiguous()}; copy it to a "
                "(pinned) CPU tensor first."
            )
        path = Path(filename)
        return self._io.write(buffer, path) if write else self._io.read(path, buffer)

    def sync_pread(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        """Fill ``buffer`` from ``filename``; returns the number of completed reads (1)."""
        self._start(False, buffer, filename, file_offset).wait()
        return 1

    def sync_pwrite(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        """Write ``buffer`` to ``filename``; returns the number of completed writes (1)."""
        self._start(True, buffer, filename, file_offset).wait()
        return 1

    def async_pread(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        """Start filling ``buffer`` from ``filename``; returns 0, :meth:`wait` completes it."""
        self._pending.append(self._start(False, buffer, filename, file_offset))
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        """Start writing ``buffer`` to ``filename``; returns 0, :meth:`wait` completes it."""
        self._pending.append(self._start(True, buffer, filename, file_offset))
        return 0

    def pread(
        self,
        buffer: torch.Tensor,
        filename: Any,
        validate: bool,
        async_op: bool,
        file_offset: int = 0,
    ) -> int:
        """Read, asynchronously when ``async_op`` (DeepSpeed's ``async`` argument)."""
        if async_op:
            return self.async_pread(buffer, filename, file_offset)
        return self.sync_pread(buffer, filename, file_offset)

    def pwrite(
        self,
        buffer: torch.Tensor,
        filename: Any,
        validate: bool,
        async_op: bool,
        file_offset: int = 0,
    ) -> int:
        """Write, asynchronously when ``async_op`` (DeepSpeed's ``async`` argument)."""
        if async_op:
            return self.async_pwrite(buffer, filename, file_offset)
        return self.sync_pwrite(buffer, filename, file_offset)

    def read(
        self, buffer: torch.Tensor, filename: Any, validate: bool, file_offset: int = 0
    ) -> int:
        """Synchronous read; returns the number of completed reads (1)."""
        return self.sync_pread(buffer, filename, file_offset)

    def write(
        self, buffer: torch.Tensor, filename: Any, validate: bool, file_offset: int = 0
    ) -> int:
        """Synchronous write; returns the number of completed writes (1)."""
        return self.sync_pwrite(buffer, filename, file_offset)

    def wait(self) -> int:
        """Block until every asynchronous request finished; returns how many there were."""
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()
        return len(pending)

    # ------------------------------------------------------------------ buffers
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype (pinned
        when an accelerator is present)."""
        tensor = torch.empty(int(num_elem), dtype=example_tensor.dtype, device="cpu")
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Release a tensor from :meth:`new_cpu_locked_tensor` (memory is freed with it)."""
        return True

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is page-locked host memory."""
        return bool(buffer.is_pinned())

    def __del__(self) -> None:
        io = getattr(self, "_io", None)
        if io is not None:
            io.close()
