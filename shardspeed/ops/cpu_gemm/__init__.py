"""A CPU kernel for fp32 linear layers on many rows, on CPUs with AVX2 + FMA and no AVX-512.

On such a CPU (AMD Zen 2/3) oneDNN's fp32 product reaches 100-135 GFLOP/s on a 200M Llama's
shapes against a 213 GFLOP/s FMA peak (2-core EPYC), and in a compute-bound FastGen run the
products are ~80% of the time. ``gemm.cpp`` packs each weight once in k-slices of 16-output
panels and multiplies in register blocks of 4-6 rows x 16 outputs (the layout and loops are
described there). Measured against oneDNN's packed product on the 200M shapes (2 threads,
weights cold in cache as in a serving step; ``benchmarks/cpu_gemm_bench.py``): 1.2-1.5x at 8-32
rows, 1.0-1.25x at 512 (docs/serving.md).

:mod:`shardspeed.inference.fastgen.cpu_prepack` packs fp32 weights (and bf16 / fp16 ones
widened to fp32 where oneDNN has no 16-bit kernels) for this kernel instead of oneDNN when
:func:`available` is true.

Numerics: fp32 fused multiply-adds over k in order within slices of 256, the slices added in
order, then nothing else: an order fixed per output that depends on neither the other rows,
nor M, nor the thread count, so a sequence's logits do not change with the batch it runs in.
It is not oneDNN's order: results differ from ``F.linear`` by fp32 rounding.

The kernel is JIT-built on first use and cached
(:func:`shardspeed.ops.cpu_adam.builder.load_extension`); a build failure, a CPU with AVX-512
or without AVX2 + FMA, or ``SHARDSPEED_FASTGEN_GEMM_CPU=0`` leaves the products on oneDNN.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from shardspeed.ops.kernel_switch import switched_on
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("gemm.cpp")
_PREFIX = "shardspeed_cpu_gemm"
_ENV = "SHARDSPEED_FASTGEN_GEMM_CPU"

_state: dict[str, Any] = {"available": None, "module": None}


def _module() -> ModuleType:
    module = _state["module"]
    if module is None:
        from shardspeed.ops.cpu_adam.builder import load_extension

        module = _state["module"] = load_extension(SOURCE, _PREFIX, "the CPU GEMM kernel")
    return module


def _switched_on() -> bool:
    return switched_on(
        _ENV,
        "the AVX2 GEMM kernel for fp32 products on CPUs with AVX2 and no AVX-512",
        "oneDNN for them",
    )


def _cpu_is_avx2_only() -> bool:
    """AVX2 + FMA without AVX-512: the only CPUs the kernel has a path for (on AVX-512 ones
    oneDNN's 16-lane kernels are used), so nothing is built elsewhere."""
    from shardspeed.ops.cpu_adam.builder import cpu_isa_flags

    flags = set(cpu_isa_flags().split())
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


def available() -> bool:
    """Whether fp32 products go through the kernel in this process (resolved once)."""
    if _state["available"] is None:
        ok = False
        if _switched_on() and _cpu_is_avx2_only():
            from shardspeed.ops.cpu_adam.builder import NativeBuildError

            try:
                ok = bool(_module().available())
            except NativeBuildError as err:
                logger.warning("The CPU GEMM kernel is unavailable, using oneDNN: %s", err)
        _state["available"] = ok
    return bool(_state["available"])


def reset() -> None:
    """Forget the resolved availability (tests; the environment is read again at next use)."""
    _state["available"] = None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 ``weight`` ``[N, K]`` in the kernel's layout (a flat fp32 tensor of
    ``ceil(N / 16) * 16 * K`` elements)."""
    return _module().pack(weight)


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for a contiguous fp32 ``x`` ``[M, K]``, ``packed`` from
    :func:`pack` and an fp32 ``bias`` ``[out_features]`` or None; returns ``[M, N]``."""
    return _module().linear(x, packed, out_features, bias)
