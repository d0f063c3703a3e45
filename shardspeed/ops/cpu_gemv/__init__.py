"""A CPU kernel for linear layers applied to 1-4 rows, reading the weight as stored.

At batch 1-2 a decode step's linears are streams over their weights; oneDNN's kernel on its
packed copy reads them at 15-22 GB/s on the 2-core AVX-512 EPYC these numbers come from,
while ``gemv.cpp`` walks each weight row front to back at 24-31 GB/s (fp32 and bf16; the
measurements are in docs/inference.md).
:mod:`shardspeed.inference.fastgen.cpu_prepack`'s packed forward sends products of at most
:func:`max_rows` rows here (4 in bf16, 2 in fp32) and larger ones to oneDNN; the int8
weight-only kernel
(:mod:`shardspeed.inference.quantization.kernels`) sends its 1-2-row products to
:func:`linear_int8`.

Numerics: fp32 accumulation, in an order fixed per output (it does not depend on the other
rows, the thread count or N), so a sequence gets the same logits whether it decodes alone or
beside one other. It is not oneDNN's order: fp32 results differ from ``F.linear`` by fp32
rounding, bf16 outputs by at most one bf16 step where the sums straddle a rounding boundary
(as oneDNN's own 1-row and 5-row products already do).

On a CPU with AVX2 + FMA and no AVX-512 (AMD Zen 2/3, for one) the kernel runs 8-lane
vectors, two accumulators per output (16 partial sums, as with AVX-512 but in another order),
bf16 and int8 weights widened to fp32 exactly. There, in bf16, it is 1.7-2.3x torch's
``F.linear`` at one row and 1.4-2.6x oneDNN's fp32 product on the widened weight at 1-2 rows
(EPYC 7xx3, 2 threads, 200M-Llama and 31M shapes; docs/inference.md).

The kernel is JIT-built on first use and cached
(:func:`shardspeed.ops.cpu_adam.builder.load_extension`); a build failure, a CPU without
AVX-512 or AVX2 + FMA (an AVX-512 CPU serves bf16 only with AVX-512-BF16), or
``SHARDSPEED_FASTGEN_GEMV_CPU=0`` leaves every product on oneDNN.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from shardspeed.ops.kernel_switch import switched_on
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("gemv.cpp")
_PREFIX = "shardspeed_cpu_gemv"
_ENV = "SHARDSPEED_FASTGEN_GEMV_CPU"

# Products with at most this many rows take the kernel, by weight dtype. Measured against
# oneDNN's packed kernel on the AMD EPYC of docs/inference.md (benchmarks/gemv_bench.py):
# - bf16: 1.4-2.1x faster at 1-2 rows (200M-Llama shapes, 2 threads), 1.2-1.5x at 3-4 rows
#   where the rows' activations take at most ACTIVATION_BYTES (K = 1024), 0.6-0.8x where they
#   take more (the 2816-wide down projection); with 1 thread (63M shapes) 1.0-1.7x at 1-4
#   rows. A speculative verify of 3 drafts is 4 rows: through the kernel it costs about a
#   1-row decode, and its logits are bitwise those the 1-row decode would get.
# - fp32: 1.2-1.9x at 1-2 rows; from 3 rows oneDNN's kernel for its 32-row layout wins (200M,
#   2 threads: 0.66-0.92x at 3-4 rows on most shapes).
# The AVX2 path (EPYC 7xx3, 2 threads) fits the same limits: bf16 1.4-2.6x the oneDNN fp32
# product on the widened weight at 1-2 rows and 1.7-2.0x at 4 rows with K <= 1024 (0.9-1.0x
# on the 2816-wide down projection at 3-4 rows, which the 16 KiB bound keeps at 2); fp32
# 1.1-3.3x at 1-2 rows and mixed at 3-4.
MAX_ROWS: dict[torch.dtype, int] = {torch.bfloat16: 4, torch.float32: 2}
# Beyond 2 rows, the kernel serves a product only while its activation rows fit in this many
# bytes (they are re-read for every weight row, from L1 when they fit beside the stream).
ACTIVATION_BYTES = 16 * 1024
# int8 weight-only products (linear_int8) take the kernel up to this many rows (measured at 1-2).
INT8_MAX_ROWS = 2
# The kernel's own limit (gemv.cpp's kMaxRows).
KERNEL_MAX_ROWS = 4


def max_rows(dtype: torch.dtype, in_features: int) -> int:
    """Products of at most this many rows with a ``dtype`` weight of ``in_features`` columns
    take the kernel (0: none do, because this process has no kernel for the dtype)."""
    if dtype not in kernel_dtypes():
        return 0
    rows = MAX_ROWS.get(dtype, 0)
    itemsize = torch.finfo(dtype).bits // 8
    while rows > 2 and rows * in_features * itemsize > ACTIVATION_BYTES:
        rows -= 1
    return rows


_state: dict[str, Any] = {"dtypes": None, "module": None}


def _module() -> ModuleType:
    module = _state["module"]
    if module is None:
        from shardspeed.ops.cpu_adam.builder import load_extension

        module = _state["module"] = load_extension(SOURCE, _PREFIX, "the CPU GEMV kernel")
    return module


def _switched_on() -> bool:
    return switched_on(
        _ENV, "the GEMV kernel for products of a few rows", "oneDNN for every product"
    )


def _cpu_has_vector_path() -> bool:
    """Whether this CPU has AVX-512F or AVX2 + FMA: without them the kernel has no code path,
    so it is not built (a ~20 s compile that would serve no dtype)."""
    from shardspeed.ops.cpu_adam.builder import cpu_isa_flags

    flags = set(cpu_isa_flags().split())
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def kernel_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes the kernel serves in this process (empty: none), resolved once:
    switched off by the environment, not built, or no AVX-512 (-BF16) on this CPU."""
    if _state["dtypes"] is None:
        dtypes: frozenset[torch.dtype] = frozenset()
        if _switched_on() and _cpu_has_vector_path():
            from shardspeed.ops.cpu_adam.builder import NativeBuildError

            try:
                names = _module().dtypes()
                dtypes = frozenset(getattr(torch, name) for name in names)
            except NativeBuildError as err:
                logger.warning(
                    "The CPU GEMV kernel is unavailable, using oneDNN and torch: %s", err
                )
        _state["dtypes"] = dtypes
    return _state["dtypes"]


def reset() -> None:
    """Forget the resolved dtypes (tests; the environment is read again at the next use)."""
    _state["dtypes"] = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M <= KERNEL_MAX_ROWS, K]`` and a contiguous ``weight``
    ``[N, K]`` of x's dtype (one in :func:`kernel_dtypes`); returns ``[M, N]``."""
    return _module().linear(x, weight, bias)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``scales * (x @ qweight.T)`` for ``x`` ``[M <= 4, K]`` (a dtype in
    :func:`kernel_dtypes`), int8 ``qweight`` ``[N, K]`` and ``scales`` ``[N]`` of x's dtype:
    ``aten._weight_int8pack_mm``'s definition; each int8 is widened exactly and the sum is
    accumulated in fp32, then scaled and rounded once."""
    return _module().linear_int8(x, qweight, scales)
