"""Pre-packed ``nn.Linear`` weights for FastGen's eager forward on CPU (oneDNN).

``F.linear`` on CPU reorders a bf16 weight into oneDNN's blocked layout on *every* call
(and runs fp32 through MKL's GEMM); for the few rows of a decode step that reorder costs
more than the product itself. Packing each weight once (``torch.ops.mkldnn.
_reorder_linear_weight``) and multiplying with ``torch.ops.mkldnn._linear_pointwise`` runs
the same oneDNN kernel without it (measured on a 2-core AVX-512-bf16 EPYC, 2 threads:
a 32000 x 384 bf16 LM head on one row 1.97 -> 0.28 ms, a 2048 x 384 projection on 32 rows
0.22 -> 0.14 ms; docs/serving.md).

Numerics: in bf16 (and fp16) the packed product is bitwise equal to ``F.linear`` (the same
kernel); in fp32 oneDNN's GEMM sums in another order than MKL's (relative differences
about 1e-6, as between MKL runs with different thread counts). fp32 is packed by default on
AVX-512 and AVX2 CPUs, where it was measured faster (AVX-512: offline 1.25x, batch-1 1.5x on
a 31M Llama; AVX2: offline 1.3x, batch-1 1.2x; docs/serving.md; every FastGen fp32 token test
against HF ``generate`` passes with it), and opt-in elsewhere; ``cpu_prepack=False`` keeps
``F.linear``'s numerics.

On a CPU with AVX2 and no AVX-512 (AMD Zen 2/3) fp32 weights, widened ones included, are
packed for :mod:`shardspeed.ops.cpu_gemm` instead, a register-blocked GEMM that was 1.0-1.5x
oneDNN's product there (its own fixed order of summation, the same for a row in any batch;
``SHARDSPEED_FASTGEN_GEMM_CPU=0`` keeps oneDNN). Parameters read as stored by the few-row
kernels move to memory on 2 MiB pages (:mod:`~shardspeed.inference.fastgen.huge_pages`).

*Widened* bf16 / fp16 (an AVX2 CPU, no oneDNN kernels for them): ``F.linear`` there converts
element by element (a 31M Llama served bf16 at 0.3x its fp32 speed), so the weight is packed
as fp32 (exact) and a product of two or more rows sums the exact products in fp32 and rounds
once to the dtype, within one step of the dtype of ``F.linear`` (offline 3.7x the unpacked
bf16 engine on a 31M Llama); one row keeps ``F.linear`` (torch's GEMV reads half the bytes of
the fp32 copy). The fp32 copy is twice the 16-bit weight's memory. Products of at most
:func:`~shardspeed.ops.cpu_gemv.max_rows` rows (bf16: up to 4, fp32: 2; decode at small batch,
a speculative verify) skip oneDNN for :mod:`~shardspeed.ops.cpu_gemv`, which streams the
parameter as stored (1.2-1.6x faster at those rows; fp32 accumulation in its own order, the
same for a row whatever the rows beside it, so bf16 outputs may differ from ``F.linear`` by
one bf16 step). The packed copy is an opaque oneDNN tensor beside
the parameter (weight memory is doubled); it is rebuilt whenever the parameter changes
(its version counter or storage), so weights updated in place are never served stale.

:func:`resolve_prepack` turns ``EngineConfig.cpu_prepack`` into a decision;
:func:`prepack_linears` installs the packed forward on every plain ``nn.Linear`` of the
weight dtype (hooks on the module, e.g. LoRA's, keep working: only ``forward`` changes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.huge_pages import huge_page_copy
from shardspeed.ops import cpu_gemm, cpu_gemv
from shardspeed.precision.cpu_support import has_fast_16bit_matmul
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

_ALL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_prepack(
    requested: bool | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    compiled: bool,
    offloaded: bool,
) -> tuple[torch.dtype, ...]:
    """The weight dtypes to pack (empty: none) for ``EngineConfig.cpu_prepack``.

    ``None`` (auto): bf16/fp16 weights on a CPU with oneDNN kernels for them, and fp32 on an
    AVX-512 CPU, unless the decode path is compiled (Inductor packs its own) or weights
    stream from an offload store. ``True`` packs every dtype and raises where packing cannot
    run; ``False``: never.
    """
    if requested is not None and not isinstance(requested, bool):
        raise ValueError(
            f"EngineConfig.cpu_prepack={requested!r} must be None (auto: bf16/fp16 weights on "
            "CPU), True (also fp32) or False."
        )
    if requested is False:
        return ()
    blockers = []
    if device.type != "cpu":
        blockers.append(f"device {device.type} (packing is for CPU)")
    if not _available():
        blockers.append("this torch build has no oneDNN (mkldnn) linear")
    if compiled:
        blockers.append("compile_decode is on (Inductor packs the weights itself)")
    if offloaded:
        blockers.append("weights stream from an offload store (a pack per layer load)")
    if blockers:
        if requested:
            raise ValueError(
                f"EngineConfig.cpu_prepack=True cannot be used here: {'; '.join(blockers)}. "
                "Fix: leave cpu_prepack unset (None) or False."
            )
        return ()
    if requested is None:  # bf16/fp16 natively or widened where measured; fp32 measured
        auto = (*_native_dtypes(), *_widened_dtypes(), *_fp32_by_default())
        return tuple(d for d in auto if d == dtype)
    return _ALL_DTYPES


def _native_dtypes() -> tuple[torch.dtype, ...]:
    """bf16 / fp16 where this CPU has oneDNN kernels for them (``F.linear`` then uses oneDNN
    too); on a CPU without them ``F.linear`` may take another path, so auto packs nothing."""
    return tuple(d for d in (torch.bfloat16, torch.float16) if has_fast_16bit_matmul(d))


def _capability() -> str:
    return getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()


def _fp32_by_default() -> tuple[torch.dtype, ...]:
    """fp32 where packing was measured faster than MKL's ``F.linear``: AVX-512 and AVX2 CPUs
    (AVX2, AMD EPYC 7xx3, 2 threads: a 32000 x 384 head at 32 rows 6.7 vs 15.6 ms)."""
    return (torch.float32,) if _capability().startswith(("AVX512", "AVX2")) else ()


def _widened_dtypes() -> tuple[torch.dtype, ...]:
    """bf16 / fp16 on an x86 CPU without oneDNN kernels for them (AVX2): ``F.linear`` then
    runs a scalar-converting GEMM (2048 x 384 at 32 rows: 3.5 ms against 0.40 ms for oneDNN's
    fp32 product), so the packed forward multiplies in fp32 on an fp32 copy of the weight
    and rounds the output to the dtype (see :class:`_PackedForward`)."""
    if not _capability().startswith("AVX2"):
        return ()
    native = _native_dtypes()
    return tuple(d for d in (torch.bfloat16, torch.float16) if d not in native)


# The row count oneDNN is told to expect when it lays out an fp32 weight. Packed for 1 row,
# fp32 products of 8-32 rows ran 1.15-1.6x slower (AMD EPYC, 2 threads: a 32000 x 384 head
# 6.3 vs 4.7 ms at 32 rows, 3.8 vs 2.1 ms at 8; FastGen fp32 offline at 31M 1.25x, A/B).
# Packed for 32, 8-512 rows give bitwise the same sums as packed for 1, 1 row was as fast or
# within 5%, and for most shapes 1 row then sums as the batched rows do (packed for 1, it
# takes a kernel of its own, ~1e-6 relative apart). bf16 / fp16 layouts did not change
# with the hint and stay packed for 1, bitwise ``F.linear``.
FP32_PACK_ROWS = 32


class _PackedForward:
    """``forward`` of one ``nn.Linear``: the oneDNN product with its weight packed once."""

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self._pack()

    def _pack(self) -> None:
        weight = self.module.weight
        # widened: a bf16 / fp16 weight on a CPU without oneDNN kernels for it is packed as
        # fp32 (exact: every bf16 / fp16 value is an fp32 value) and multiplied in fp32
        self.widened = weight.dtype != torch.float32 and weight.dtype not in _native_dtypes()
        source = weight.detach().float() if self.widened else weight.detach()
        # fp32 products (widened ones too) on an AVX2 CPU without AVX-512: the register-
        # blocked kernel of cpu_gemm, 1.0-1.5x oneDNN's there; elsewhere oneDNN's packing
        self.gemm = source.dtype == torch.float32 and cpu_gemm.available()
        if self.gemm:
            self.packed = cpu_gemm.pack(source.contiguous())
        else:
            rows = FP32_PACK_ROWS if source.dtype == torch.float32 else 1
            self.packed = torch.ops.mkldnn._reorder_linear_weight(source, rows)
        self.key = (weight._version, weight.data_ptr())
        bias = self.module.bias
        # a few rows (decode at batch 1-4, a speculative verify) read the weight as stored,
        # through cpu_gemv; 0: every product goes to oneDNN
        eligible = weight.is_contiguous() and (
            bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())
        )
        self.gemv_rows = cpu_gemv.max_rows(weight.dtype, weight.shape[1]) if eligible else 0
        if self.gemv_rows or self.widened:  # few rows stream the parameter as stored
            self._to_huge_pages()

    def _to_huge_pages(self) -> None:
        """Move the parameter's data to memory on 2 MiB pages (see fastgen/huge_pages.py)."""
        weight = self.module.weight
        if weight._base is not None:
            return
        copy = huge_page_copy(weight.detach())
        if copy is not None:
            weight.data = copy
            self.key = (weight._version, weight.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        if (weight._version, weight.data_ptr()) != self.key:  # updated in place: repack
            self._pack()
        if x.dtype != weight.dtype or (weight.requires_grad and torch.is_grad_enabled()):
            return nn.functional.linear(x, weight, self.module.bias)
        if 0 < x.numel() <= self.gemv_rows * x.shape[-1]:
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            out = cpu_gemv.linear(flat, weight, self.module.bias)
            return out.view(*x.shape[:-1], weight.shape[0])
        bias = self.module.bias
        if self.widened:
            if x.numel() == x.shape[-1]:  # one row: torch's GEMV reads the 16-bit weight,
                return nn.functional.linear(x, weight, bias)  # half the fp32 copy's bytes
            # fp32 sums of the exact products, rounded once to the dtype
            bias = None if bias is None else bias.float()
            return self._product(x.float(), bias).to(x.dtype)
        return self._product(x, bias)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product on the packed weight, by cpu_gemm or oneDNN."""
        if not self.gemm:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        out_features = self.module.weight.shape[0]
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = cpu_gemm.linear(flat, self.packed, out_features, bias)
        return out.view(*x.shape[:-1], out_features)


def prepack_linears(model: nn.Module, dtypes: tuple[torch.dtype, ...]) -> int:
    """Install the packed forward on every plain ``nn.Linear`` whose weight dtype is in
    ``dtypes`` (subclasses, e.g. quantized layers, are left alone); returns how many."""
    if not dtypes:
        return 0
    count, numel, extra, widened, gemm = 0, 0, 0, 0, 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not nn.Linear or module.weight.dtype not in dtypes:
                continue
            if module.weight.device.type != "cpu":
                continue
            packed = _PackedForward(module)
            module.forward = packed  # type: ignore[method-assign]
            count += 1
            numel += module.weight.numel()
            extra += packed.packed.numel() * packed.packed.element_size()
            widened += int(packed.widened)
            gemm += int(packed.gemm)
    if count:
        logger.info(
            "cpu_prepack: %d linear weights packed for %s (%.1f M elements; the packed "
            "copies sit beside the parameters: %s more memory%s; cpu_prepack=False "
            "turns packing off)",
            count,
            "oneDNN"
            if not gemm
            else "the AVX2 GEMM kernel"
            if gemm == count
            else f"the AVX2 GEMM kernel ({gemm}) and oneDNN ({count - gemm})",
            numel / 1e6,
            f"{extra / 2**30:.2f} GiB" if extra >= 2**30 else f"{extra / 2**20:.1f} MiB",
            f", {widened} of them widened to fp32 copies, twice the 16-bit weights' bytes"
            if widened
            else "",
        )
    return count


def pack_worker_model(model: nn.Module, requested: bool | None, device: torch.device) -> int:
    """Pack a model built outside the engine (a tensor / pipeline / expert-parallel worker
    rank's, pipeline stage 0's, a draft model) as the engine packs its own: ``requested`` is
    ``EngineConfig.cpu_prepack``; the weight dtype is the model's first floating parameter's."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return 0
    packed = resolve_prepack(requested, device, dtype, compiled=False, offloaded=False)
    return prepack_linears(model, packed)


def is_prepacked(module: Any) -> bool:
    """True when ``module``'s forward is the packed one."""
    return isinstance(getattr(module, "__dict__", {}).get("forward"), _PackedForward)
