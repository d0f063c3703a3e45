"""FastGen's native CPU decode attention over the blocked KV cache.

:func:`paged_decode` attends one query token per sequence over each sequence's KV blocks,
read in place through its block table (``paged_decode.cpp``, JIT-built on first use and
cached like the CPU Adam kernel: :func:`shardspeed.ops.cpu_adam.builder.load_extension`).
It replaces the torch backend's per-group gather + padded SDPA for decodes (the
``"cpu"`` attention backend); prompt chunks keep SDPA. Scores, softmax and the weighted sum
are computed in fp32 whatever the cache dtype (fp32, bf16, fp16).

:func:`kernel_available` says once per process whether the kernel builds and loads here;
a failure is logged with its reason and the engine keeps the torch backend.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
_PREFIX = "shardspeed_paged_decode"
_failure: str | None = None


def _module() -> ModuleType:
    from shardspeed.ops.cpu_adam.builder import load_extension

    return load_extension(SOURCE, _PREFIX, "FastGen's CPU paged-attention kernel")


def kernel_available() -> bool:
    """Whether the native kernel builds and loads in this process (logged once if not)."""
    global _failure
    from shardspeed.ops.cpu_adam.builder import NativeBuildError

    try:
        _module()
    except NativeBuildError as err:
        if _failure is None:
            _failure = str(err)
            logger.warning(
                "FastGen's CPU attention kernel is unavailable, using the torch backend: %s",
                err,
            )
        return False
    return True


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[S, H, D]`` attention of each sequence's one query over its first ``context_lens``
    keys (the last ``window`` of them with a sliding window; ``softcap``: Gemma 2's score
    capping).

    ``q``: ``[S, H, D]``; ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, H_kv, D]``
    (contiguous, q's dtype); ``block_table``: ``[S, max_blocks]`` int64 (unused entries
    are never read); ``context_lens``: ``[S]`` int64, each >= 1.
    """
    return _module().paged_decode(
        q, k_cache, v_cache, block_table, context_lens,
        float(scale), int(window or 0), float(softcap or 0.0),
    )  # fmt: skip
