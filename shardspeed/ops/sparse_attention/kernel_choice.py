"""Which block-sparse kernel runs a call: Triton on CUDA when it can, PyTorch otherwise.

=========  ==================================================================================
choice     behaviour
=========  ==================================================================================
auto       CUDA input, Triton importable and the call supported -> Triton; anything else ->
           the PyTorch kernel (on CUDA the reason is logged once). The default.
triton     Triton or a ``ValueError`` saying why it cannot run. CPU tensors need Triton's
           interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is first imported).
torch      the pure-PyTorch kernel (``block_sparse.py``), on any device.
=========  ==================================================================================

The choice comes from the ``kernel=`` argument, else from the environment variable
``SHARDSPEED_SPARSE_ATTENTION_KERNEL``, else ``auto``. Nothing here imports ``triton`` until a
call could use it, so the package imports cleanly without Triton.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

KERNELS = ("auto", "triton", "torch")
KERNEL_ENV = "SHARDSPEED_SPARSE_ATTENTION_KERNEL"
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_TRITON_BLOCK = 16  # tl.dot needs tiles of at least 16 x 16
MAX_TRITON_HEAD_DIM = 256  # one (block, head_dim) tile per operand must fit on chip
MAX_TRITON_BATCH_HEADS = 65535  # batch * heads is the grid's second axis (CUDA's y limit)


def requested_kernel(kernel: str | None) -> str:
    """The validated choice: ``kernel`` if given, else the environment variable, else auto."""
    source = "kernel"
    if kernel is None:
        kernel = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
        source = KERNEL_ENV
    if kernel not in KERNELS:
        raise ValueError(
            f"{source}={kernel!r} is not a block-sparse kernel; use one of {KERNELS}: 'auto' "
            "(Triton on CUDA when available, else PyTorch), 'triton' or 'torch' to force one."
        )
    return kernel


@functools.cache
def _triton_import_error() -> str | None:
    """None when the Triton kernels import, else the import error (cached per process)."""
    try:
        import shardspeed.ops.sparse_attention.triton_kernels  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def triton_unsupported(query: torch.Tensor, block: int) -> str | None:
    """Why the Triton kernel cannot run this call, or None when it can."""
    if query.dtype not in TRITON_DTYPES:
        return f"dtype {query.dtype} is not one of {TRITON_DTYPES}"
    if block < MIN_TRITON_BLOCK or block & (block - 1):
        return f"block size {block} is not a power of two >= {MIN_TRITON_BLOCK}"
    if query.shape[-1] > MAX_TRITON_HEAD_DIM:
        return f"head_dim {query.shape[-1]} is larger than {MAX_TRITON_HEAD_DIM}"
    if query.shape[0] * query.shape[1] > MAX_TRITON_BATCH_HEADS:
        return f"batch * heads = {query.shape[0] * query.shape[1]} exceeds {MAX_TRITON_BATCH_HEADS}"
    error = _triton_import_error()
    if error is not None:
        return f"triton cannot be imported ({error}); install it with `pip install triton`"
    from shardspeed.ops.sparse_attention.triton_kernels import INTERPRETED

    if not query.is_cuda and not INTERPRETED:
        return (
            f"the input is on {query.device}; Triton kernels run on CUDA, or on CPU in Triton's "
            "interpreter only when TRITON_INTERPRET=1 is set before `triton` is first imported "
            "in the process"
        )
    return None


@functools.cache
def _log_fallback_once(reason: str) -> None:
    logger.info("block-sparse attention: using the PyTorch kernel on CUDA because %s.", reason)


def choose_kernel(kernel: str | None, query: torch.Tensor, block: int) -> str:
    """``"triton"`` or ``"torch"`` for a call on ``query`` (B, H, L, D) with ``block``-sized
    layout blocks; raises ``ValueError`` when ``triton`` is forced but cannot run."""
    choice = requested_kernel(kernel)
    if choice == "torch" or (choice == "auto" and not query.is_cuda):
        return "torch"
    reason = triton_unsupported(query, block)
    if reason is None:
        return "triton"
    if choice == "triton":
        raise ValueError(
            f"The Triton block-sparse kernel was requested but cannot run this call: {reason}. "
            f"Use kernel='torch' or 'auto' (or unset {KERNEL_ENV}) to run the PyTorch kernel."
        )
    _log_fallback_once(reason)
    return "torch"
