"""Matmul strategies for quantized weights: torch's weight-only kernels and the reference.

Each kernel turns the canonical :class:`QuantizedWeight` into the buffers it needs
(``pack``) and computes ``x @ W.T`` from them (``matmul``). Chosen once per layer by
:func:`select_kernel`; the module never switches on the kernel type.

=====================  ===========================================  =======================
kernel                 torch op                                      buffers
=====================  ===========================================  =======================
``reference``          none: dequantize, then ``F.linear``          qweight (canonical),
                                                                     scales fp32, zeros int
``torch_int8``         ``aten._weight_int8pack_mm`` (CPU, CUDA)     qweight int8 (N, K),
                                                                     scales (N,), [szp (N,)]
``torch_int4_cpu``     ``aten._weight_int4pack_mm_for_cpu``         qweight packed,
                                                                     scales (G, N, 2)
``torch_int4_cuda``    ``aten._weight_int4pack_mm``                 qweight packed,
                                                                     scales (G, N, 2)
=====================  ===========================================  =======================

torch's int4 kernels dequantize as ``(q - 8) * scale + zero`` with a float zero, so our
integer zero point ``z`` becomes ``zero = (8 - z) * scale``. Its int8 kernel is symmetric
per channel; an asymmetric int8 weight adds ``- sum_k(x) * scale * z`` afterwards.

``pack(qw, compute_dtype, device)`` returns buffers on ``qw``'s device laid out for
``device`` (the device ``matmul`` will run on), so a model can be quantized on the host
for a GPU it is moved to later (ZeRO-Inference loads this way). Only ``torch_int4_cuda``
needs the device itself for packing: its layout op runs on CUDA, one weight at a time.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from shardspeed.inference.quantization.qtensor import QuantizedWeight, pack_int4, unpack_int4
from shardspeed.ops import cpu_gemv

logger = logging.getLogger(__name__)

Buffers = dict[str, torch.Tensor]


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


class QuantKernel:
    """Base strategy: ``pack`` once at load, ``matmul`` per call."""

    name = "base"

    def supports(
        self, qw: QuantizedWeight, device: torch.device, compute_dtype: torch.dtype
    ) -> str | None:
        """None if this kernel can run ``qw`` on ``device`` in ``compute_dtype``, else why not."""
        raise NotImplementedError

    def pack(
        self, qw: QuantizedWeight, compute_dtype: torch.dtype, device: torch.device | None = None
    ) -> Buffers:
        """The buffers ``matmul`` reads, on ``qw``'s device, laid out for ``device``
        (the device ``matmul`` runs on; None: ``qw``'s)."""
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, buffers: Buffers, qmeta: QuantMeta) -> torch.Tensor:
        """``x``: (M, K) in the compute dtype -> (M, N)."""
        raise NotImplementedError


class QuantMeta:
    """The plain facts a kernel needs at call time (no tensors)."""

    __slots__ = ("bits", "group_size", "symmetric", "shape")

    def __init__(self, qw: QuantizedWeight) -> None:
        self.bits = qw.bits
        self.group_size = qw.group_size
        self.symmetric = qw.symmetric
        self.shape = qw.shape

    def __repr__(self) -> str:
        return (
            f"QuantMeta(bits={self.bits}, group_size={self.group_size}, "
            f"symmetric={self.symmetric}, shape={self.shape})"
        )


class ReferenceKernel(QuantKernel):
    """Dequantize the canonical form on the fly, then ``F.linear``: the test oracle."""

    name = "reference"

    def supports(
        self, qw: QuantizedWeight, device: torch.device, compute_dtype: torch.dtype
    ) -> str | None:
        return None

    def pack(
        self, qw: QuantizedWeight, compute_dtype: torch.dtype, device: torch.device | None = None
    ) -> Buffers:
        buffers = {"qweight": qw.qdata, "scales": qw.scales}
        if qw.zeros is not None:
            zero_dtype = torch.int8 if qw.bits == 8 else torch.uint8  # exact: integer-valued
            buffers["zeros"] = qw.zeros.to(zero_dtype)
        return buffers

    def dequantize(self, buffers: Buffers, meta: QuantMeta, dtype: torch.dtype) -> torch.Tensor:
        n, k = meta.shape
        gs = meta.group_size
        q = buffers["qweight"]
        q = q.to(torch.int32) if meta.bits == 8 else unpack_int4(q)  # (N, K)
        q = q.reshape(n, k // gs, gs).float()  # (N, G, gs)
        if "zeros" in buffers:
            zeros = buffers["zeros"].float()
        else:
            zeros = torch.full_like(buffers["scales"], 8.0 if meta.bits == 4 else 0.0)
        w = (q - zeros[..., None]) * buffers["scales"].float()[..., None]  # (N, G, gs)
        return w.reshape(n, k).to(dtype)  # (N, K)

    def matmul(self, x: torch.Tensor, buffers: Buffers, qmeta: QuantMeta) -> torch.Tensor:
        return F.linear(x, self.dequantize(buffers, qmeta, x.dtype))


class TorchInt8Kernel(QuantKernel):
    """``aten._weight_int8pack_mm``: int8 per-output-channel weights."""

    name = "torch_int8"

    def supports(
        self, qw: QuantizedWeight, device: torch.device, compute_dtype: torch.dtype
    ) -> str | None:
        if not _has_op("_weight_int8pack_mm"):
            return "this torch build has no aten._weight_int8pack_mm"
        if qw.bits != 8:
            return "the int8 kernel needs 8-bit weights"
        if qw.group_size != qw.shape[1]:
            return f"the int8 kernel is per-channel only (group_size={qw.group_size})"
        if device.type not in ("cpu", "cuda"):
            return f"no int8 kernel for device {device.type}"
        if qw.zeros is not None and compute_dtype != torch.float32:
            # the zero-point correction is applied after the kernel's output is rounded to
            # compute_dtype; a large zero point then cancels most of that output's bits
            return "asymmetric int8 uses the kernel only with compute_dtype=float32"
        if device.type == "cpu" and compute_dtype == torch.bfloat16 and qw.shape[1] % 16:
            # torch 2.13's CPU kernel reads past the row end for bf16 activations when K is
            # not a multiple of 16: it crashes or returns garbage (checked for K = 8, 24, 31,
            # 1000 at 1 and 4 rows; fp32 and fp16 are correct)
            return (
                f"torch's CPU int8 kernel is wrong for bf16 with in_features={qw.shape[1]} "
                "(not a multiple of 16)"
            )
        return None

    def pack(
        self, qw: QuantizedWeight, compute_dtype: torch.dtype, device: torch.device | None = None
    ) -> Buffers:
        scales = qw.scales[:, 0]  # (N, 1) -> (N,)
        buffers = {"qweight": qw.qdata.contiguous(), "scales": scales.to(compute_dtype)}
        if qw.zeros is not None:
            buffers["szp"] = (scales * qw.zeros[:, 0]).float()  # (N,) fp32 correction
        return buffers

    def matmul(self, x: torch.Tensor, buffers: Buffers, qmeta: QuantMeta) -> torch.Tensor:
        scales = buffers["scales"].to(x.dtype)
        if "szp" not in buffers and _gemv_rows(x, buffers["qweight"]):
            # 1-2 rows (decode at batch 1-2) on CPU: FastGen's streaming kernel, the same
            # y = scales * (x @ q.T) read at ~1.5x (bf16) / ~10x (fp32) torch's speed here
            return cpu_gemv.linear_int8(x.contiguous(), buffers["qweight"], scales.contiguous())
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), buffers["qweight"], scales)
        if "szp" not in buffers:
            return y  # (M, N)
        # asymmetric: W = s * (q - z)  =>  x @ W.T = s * (x @ q.T) - sum_k(x) * (s * z)
        x_sum = x.float().sum(-1, keepdim=True)  # (M, 1)
        return y.float() - x_sum * buffers["szp"]  # (M, N) fp32


def _gemv_rows(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether ``cpu_gemv`` serves this int8 product: a CPU product of at most
    ``cpu_gemv.INT8_MAX_ROWS`` rows in a dtype it has a kernel for."""
    return (
        x.device.type == "cpu"
        and qweight.device.type == "cpu"
        and 0 < x.shape[0] <= cpu_gemv.INT8_MAX_ROWS
        and x.dtype in cpu_gemv.kernel_dtypes()
    )


def _int4_scale_and_zeros(qw: QuantizedWeight, compute_dtype: torch.dtype) -> torch.Tensor:
    """torch's int4 ``(G, N, 2)`` table: ``[..., 0]`` scale, ``[..., 1]`` float zero."""
    zero_float = (8.0 - qw.zero_points()) * qw.scales  # (N, G)
    table = torch.stack([qw.scales, zero_float], dim=-1)  # (N, G, 2)
    return table.transpose(0, 1).contiguous().to(compute_dtype)  # (G, N, 2)


class TorchInt4CpuKernel(QuantKernel):
    """``aten._weight_int4pack_mm_for_cpu``: int4 group-wise weights on CPU."""

    name = "torch_int4_cpu"

    def supports(
        self, qw: QuantizedWeight, device: torch.device, compute_dtype: torch.dtype
    ) -> str | None:
        ops = ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
        if not all(_has_op(op) for op in ops):
            return "this torch build has no aten._weight_int4pack_mm_for_cpu"
        if qw.bits != 4:
            return "the int4 kernel needs 4-bit weights"
        if device.type != "cpu":
            return "the CPU int4 kernel runs on CPU only"
        return None

    def pack(
        self, qw: QuantizedWeight, compute_dtype: torch.dtype, device: torch.device | None = None
    ) -> Buffers:
        q = qw.int_values()  # (N, K) int32 in [0, 15]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        return {"qweight": packed, "scales": _int4_scale_and_zeros(qw, compute_dtype)}

    def matmul(self, x: torch.Tensor, buffers: Buffers, qmeta: QuantMeta) -> torch.Tensor:
        table = buffers["scales"].to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), buffers["qweight"], qmeta.group_size, table
        )  # (M, N)


class TorchInt4CudaKernel(QuantKernel):
    """``aten._weight_int4pack_mm``: int4 group-wise weights on CUDA (bf16 activations)."""

    name = "torch_int4_cuda"
    inner_k_tiles = 8

    def supports(
        self, qw: QuantizedWeight, device: torch.device, compute_dtype: torch.dtype
    ) -> str | None:
        if not all(_has_op(op) for op in ("_weight_int4pack_mm", "_convert_weight_to_int4pack")):
            return "this torch build has no aten._weight_int4pack_mm"
        if qw.bits != 4:
            return "the int4 kernel needs 4-bit weights"
        if device.type != "cuda":
            return "the CUDA int4 kernel runs on CUDA only"
        n, k = qw.shape
        if n % 8 != 0 or k % (self.inner_k_tiles * 16) != 0:
            return f"the CUDA int4 kernel needs N % 8 == 0 and K % 128 == 0, got {qw.shape}"
        return None

    def pack(
        self, qw: QuantizedWeight, compute_dtype: torch.dtype, device: torch.device | None = None
    ) -> Buffers:
        q = qw.int_values()  # (N, K) int32 in [0, 15]
        high_first = pack_int4(torch.stack([q[:, 1::2], q[:, 0::2]], -1).flatten(-2))  # (N, K/2)
        # the layout op runs on CUDA only: pack there, hand the result back where qw lives
        target = device if device is not None else qw.qdata.device
        packed = torch.ops.aten._convert_weight_to_int4pack(
            high_first.to(target), self.inner_k_tiles
        ).to(qw.qdata.device)
        return {"qweight": packed, "scales": _int4_scale_and_zeros(qw, compute_dtype)}

    def matmul(self, x: torch.Tensor, buffers: Buffers, qmeta: QuantMeta) -> torch.Tensor:
        table = buffers["scales"].to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm(
            x.contiguous(), buffers["qweight"], qmeta.group_size, table
        )  # (M, N)


REFERENCE = ReferenceKernel()
_TORCH_KERNELS: tuple[QuantKernel, ...] = (
    TorchInt8Kernel(),
    TorchInt4CpuKernel(),
    TorchInt4CudaKernel(),
)


def select_kernel(
    qw: QuantizedWeight, device: torch.device, compute_dtype: torch.dtype, preference: str
) -> QuantKernel:
    """The kernel for one weight: ``preference`` is ``"auto"``, ``"torch"`` or ``"reference"``.

    ``compute_dtype`` is the activation dtype the torch kernels would run in.
    """
    if preference == "reference":
        return REFERENCE
    reasons = []
    for kernel in _TORCH_KERNELS:
        why_not = kernel.supports(qw, device, compute_dtype)
        if why_not is None:
            return kernel
        reasons.append(f"{kernel.name}: {why_not}")
    if preference == "torch":
        raise ValueError(
            f"WeightQuantConfig.kernel='torch' but no torch weight-only kernel fits a "
            f"{qw.bits}-bit weight {qw.shape} (group_size={qw.group_size}) on {device}: "
            f"{'; '.join(reasons)}. Use kernel='auto' to fall back to the reference path."
        )
    return REFERENCE
