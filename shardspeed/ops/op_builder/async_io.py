"""Builders of the file I/O ops: ``AsyncIOBuilder`` (implemented) and ``GDSBuilder`` (not).

``async_io``: :mod:`shardspeed.ops.op_builder.aio_op`, whose ``aio_handle`` moves tensors
to and from files on the thread pool of ShardSpeed's NVMe offload (POSIX ``pread`` /
``pwrite``; no libaio needed). ``gds``: GPUDirect Storage, which ShardSpeed lacks.
"""

from __future__ import annotations

import os

from shardspeed.ops.op_builder.builder import PythonOpBuilder, UnavailableOpBuilder


class AsyncIOBuilder(PythonOpBuilder):
    """Asynchronous tensor file I/O: ``load().aio_handle(...)``."""

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"
    ABSOLUTE_NAME = "shardspeed.ops.op_builder.aio_op"

    def unavailable_reason(self) -> str | None:
        if not (hasattr(os, "preadv") and hasattr(os, "pwrite")):
            return (
                "the swap I/O needs os.preadv and os.pwrite, which this platform lacks; "
                "run on Linux (or offload to cpu instead of nvme)."
            )
        return None


class GDSBuilder(UnavailableOpBuilder):
    """GPUDirect Storage (cuFile) I/O."""

    BUILD_VAR = "DS_BUILD_GDS"
    NAME = "gds"
    ABSOLUTE_NAME = "deepspeed.ops.gds.gds_op"
    WHAT = "GPUDirect Storage (cuFile) reads and writes"
    INSTEAD = (
        "Use AsyncIOBuilder().load().aio_handle(), which moves data through host memory; "
        "ZeRO-Infinity's device: nvme uses the same path."
    )
