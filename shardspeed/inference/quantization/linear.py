"""``QuantizedLinear``: a drop-in for ``nn.Linear`` / GPT-2 ``Conv1D`` with int weights."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from shardspeed.inference.quantization.config import WeightQuantConfig
from shardspeed.inference.quantization.kernels import (
    REFERENCE,
    QuantKernel,
    QuantMeta,
    select_kernel,
)
from shardspeed.inference.quantization.qtensor import (
    QuantizedWeight,
    dequantize_weight,
    quantize_weight,
)

logger = logging.getLogger(__name__)

# (kernel name, device type, compute dtype) -> the kernel agreed with the reference
_VERIFIED: dict[tuple[str, str, torch.dtype], bool] = {}
_CHECK_TOLERANCE = 2e-2  # max |kernel - reference| / max |reference| on a random input
_CHECK_ROWS = 64  # output rows the kernel check runs (a multiple of every kernel's tile)


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` stored as int8 / int4 plus scales (and zero points).

    Weights are quantized once at construction; ``forward`` runs the chosen kernel
    (torch's weight-only op, or dequantize + ``F.linear`` for the reference path) in
    ``compute_dtype`` and returns the input's dtype. The quantized tensors are
    buffers (they follow ``.to(device)`` and appear in ``state_dict``); the bias stays
    a frozen parameter in its original dtype. ``device`` is where ``forward`` will run
    (None: where ``qweight`` is); the buffers stay on ``qweight``'s device, laid out for it.
    """

    def __init__(
        self,
        qweight: QuantizedWeight,
        bias: torch.Tensor | None,
        kernel: QuantKernel,
        compute_dtype: torch.dtype | None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.meta = QuantMeta(qweight)
        self.kernel = kernel
        self.compute_dtype = compute_dtype
        pack_dtype = compute_dtype or qweight.scales.dtype
        self._buffer_names = []
        for name, tensor in kernel.pack(qweight, pack_dtype, device).items():
            self.register_buffer(name, tensor)
            self._buffer_names.append(name)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        config: WeightQuantConfig,
        device: torch.device | None = None,
    ) -> QuantizedLinear:
        """Quantize an ``(out, in)`` weight per ``config`` and pick its kernel.

        ``device`` is where the layer will run (None: ``weight``'s device); the kernel and
        its packing are chosen for it while the buffers stay on ``weight``'s device (so a
        model quantized on the host can move to its GPU afterwards).
        """
        qw = quantize_weight(weight, config.bits, config.effective_group_size, config.symmetric)
        return cls.from_quantized(qw, bias, config, weight.device if device is None else device)

    @classmethod
    def from_quantized(
        cls,
        qw: QuantizedWeight,
        bias: torch.Tensor | None,
        config: WeightQuantConfig,
        device: torch.device | None = None,
    ) -> QuantizedLinear:
        """A layer multiplying by an already quantized weight ``qw`` (e.g. one
        tensor-parallel rank's slice of a weight quantized whole), with the kernel
        ``config`` selects for ``device`` (None: ``qw``'s device)."""
        device = qw.qdata.device if device is None else torch.device(device)
        # the torch kernels run in bf16 unless told otherwise: their fast dtype on CPU and
        # the only one of CUDA int4; the reference path computes in the input's dtype
        kernel_dtype = config.resolved_compute_dtype() or torch.bfloat16
        kernel = select_kernel(qw, device, kernel_dtype, config.kernel)
        compute_dtype = config.resolved_compute_dtype()
        if kernel is not REFERENCE:
            compute_dtype = kernel_dtype
        if kernel is not REFERENCE and not _kernel_agrees(qw, kernel, device, compute_dtype):
            if config.kernel == "torch":
                raise RuntimeError(
                    f"torch kernel {kernel.name} disagrees with the reference path on "
                    f"{device} ({compute_dtype}); use WeightQuantConfig(kernel='auto')."
                )
            kernel, compute_dtype = REFERENCE, config.resolved_compute_dtype()
        return cls(qw, bias, kernel, compute_dtype, device)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: WeightQuantConfig, device: torch.device | None = None
    ) -> QuantizedLinear:
        """Quantize an ``nn.Linear`` (weight ``(out, in)``) to run on ``device``."""
        return cls.from_weight(linear.weight, linear.bias, config, device)

    @classmethod
    def from_conv1d(
        cls, conv: nn.Module, config: WeightQuantConfig, device: torch.device | None = None
    ) -> QuantizedLinear:
        """Quantize a ``transformers`` ``Conv1D`` (GPT-2), whose weight is ``(in, out)``."""
        return cls.from_weight(conv.weight.t(), conv.bias, config, device)

    # ------------------------------------------------------------------ compute

    def _quant_buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._buffer_names}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # (M, K), M = prod(lead)
        compute_dtype = self.compute_dtype or x.dtype
        y = self.kernel.matmul(x2d.to(compute_dtype), self._quant_buffers(), self.meta)  # (M, N)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)  # (..., N)

    # ------------------------------------------------------------------ inspection

    def weight_nbytes(self) -> int:
        """Bytes of the quantized weight: packed ints + scales + zero points (no bias)."""
        return sum(t.numel() * t.element_size() for t in self._quant_buffers().values())

    @torch.no_grad()
    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``(out, in)`` weight this layer multiplies by (any kernel layout).

        Runs the kernel on an identity matrix, so it reflects exactly what
        ``forward`` computes (up to the compute dtype).
        """
        if self.kernel is REFERENCE:
            return REFERENCE.dequantize(self._quant_buffers(), self.meta, dtype)
        device = self.qweight.device
        eye = torch.eye(self.in_features, device=device, dtype=self.compute_dtype)  # (K, K)
        return self.kernel.matmul(eye, self._quant_buffers(), self.meta).t().to(dtype)  # (N, K)

    def extra_repr(self) -> str:
        scheme = f"int{self.meta.bits}"
        group = (
            "per-channel"
            if self.meta.group_size == self.in_features
            else f"group_size={self.meta.group_size}"
        )
        sym = "symmetric" if self.meta.symmetric else "asymmetric"
        cdt = str(self.compute_dtype).replace("torch.", "") if self.compute_dtype else "input"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {scheme}, "
            f"{group}, {sym}, kernel={self.kernel.name}, compute_dtype={cdt}, "
            f"bias={self.bias is not None}"
        )


def _kernel_agrees(
    qw: QuantizedWeight, kernel: QuantKernel, device: torch.device, compute_dtype: torch.dtype
) -> bool:
    """Check a torch kernel against the reference once per (kernel, device, dtype).

    Guards against layout conventions that differ between torch builds: a mismatch
    falls back to the reference path with a warning instead of wrong outputs. Runs on
    ``device`` with the first ``_CHECK_ROWS`` output rows only (a layout check needs no
    more), so the check adds little to the device's memory while a model loads.
    """
    key = (kernel.name, device.type, compute_dtype)
    if key in _VERIFIED:
        return _VERIFIED[key]
    qw = _first_rows(qw, _CHECK_ROWS, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, qw.shape[1], generator=gen).to(device=device, dtype=compute_dtype)
    reference = torch.nn.functional.linear(x.float(), dequantize_weight(qw))
    got = kernel.matmul(x, kernel.pack(qw, compute_dtype, device), QuantMeta(qw)).float()
    err = ((got - reference).abs().max() / reference.abs().max().clamp_min(1e-6)).item()
    ok = err <= _CHECK_TOLERANCE
    if not ok:
        logger.warning(
            "weight-only kernel %s on %s (%s) differs from the reference by %.3g (relative); "
            "using the dequantize reference path instead",
            kernel.name, device.type, compute_dtype, err,
        )  # fmt: skip
    _VERIFIED[key] = ok
    return ok


def _first_rows(qw: QuantizedWeight, rows: int, device: torch.device) -> QuantizedWeight:
    """The first ``rows`` output rows of ``qw`` (all when it has fewer), copied to ``device``."""
    n, k = qw.shape
    keep = min(n, rows)
    zeros = None if qw.zeros is None else qw.zeros[:keep].to(device)
    return QuantizedWeight(
        qw.qdata[:keep].to(device), qw.scales[:keep].to(device), zeros, qw.bits,
        qw.group_size, (keep, k),
    )  # fmt: skip
