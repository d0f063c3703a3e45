"""Quantizers and the top-k binarizer: pure tensor functions plus their straight-through ops.

Every function here works on a tensor viewed as ``(num_groups, group_numel)`` and returns a
tensor of the input's shape. The ``*_ste`` wrappers are autograd functions whose backward is
the identity (straight-through estimator), so a layer can train through its own quantized
weight or activation. Formulas (``q = 2 ** bits``):

* symmetric:  ``scale = 2 * max|x| / q``;  ``round(x / scale)`` clamped to ``[-q/2, q/2 - 1]``
* asymmetric: ``scale = (max - min) / q``; ``zero = round(min / scale) * scale``;
  ``round((x - zero) / scale)`` clamped to ``[0, q - 1]``, then ``* scale + zero``
* ternary (2 bits): ``t = 0.7 * mean|x|``; ``alpha = mean(|x| where |x| > t)``;
  ``alpha * sign(x)`` where ``|x| > t``, else 0
* binary (1 bit): ``mean|x| * sign(x)``
* top-k mask: 1 for the ``ceil(ratio * numel)`` largest scores, 0 elsewhere
"""

from __future__ import annotations

import math
from typing import Any

import torch

SYMMETRIC = "symmetric"
ASYMMETRIC = "asymmetric"


def topk_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """0/1 mask of ``scores``' shape keeping the ``ceil(dense_ratio * numel)`` largest."""
    mask = scores.clone()
    flat = mask.view(-1)
    # descending sort of the flattened scores; ties resolve as torch.sort orders them
    _, order = scores.flatten().sort(descending=True)
    num_kept = math.ceil(dense_ratio * scores.numel())
    flat[order[num_kept:]] = 0.0
    flat[order[:num_kept]] = 1.0
    return mask


def quantize_symmetric(
    x: torch.Tensor,
    num_bits: int,
    num_groups: int = 1,
    x_min: torch.Tensor | None = None,
    x_max: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Symmetric uniform quantization (per group, or with a static ``x_min``/``x_max``)."""
    q_range = 2**num_bits
    if x_min is None or x_max is None:
        grouped = x.reshape(num_groups, -1)  # (G, numel / G)
        max_abs = torch.amax(torch.abs(grouped), dim=-1).view(num_groups, -1)  # (G, 1)
    else:
        grouped = x
        max_abs = torch.max(x_min.abs(), x_max).view(-1)
    scale = 2 * max_abs / q_range
    scaled = grouped / scale if noise is None else grouped / scale + noise
    out = scaled.round().clamp(-q_range // 2, q_range // 2 - 1) * scale
    return out.reshape(x.shape).contiguous()


def quantize_asymmetric(
    x: torch.Tensor,
    num_bits: int,
    num_groups: int = 1,
    x_min: torch.Tensor | None = None,
    x_max: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Asymmetric (min/max, zero point) uniform quantization."""
    q_range = 2**num_bits
    if x_min is None or x_max is None:
        grouped = x.reshape(num_groups, -1)  # (G, numel / G)
        x_min = grouped.amin(dim=-1, keepdim=True)  # (G, 1)
        x_max = grouped.amax(dim=-1, keepdim=True)
    else:
        grouped = x
    scale = (x_max - x_min) / q_range
    zero_point = (x_min / scale).round() * scale
    scaled = (grouped - zero_point) / scale
    if noise is not None:
        scaled = scaled + noise
    out = scaled.round().clamp(0, q_range - 1) * scale + zero_point
    return out.reshape(x.shape).contiguous()


def quantize_ternary(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Ternary weights ``{-alpha, 0, alpha}`` per group (threshold ``0.7 * mean|x|``)."""
    grouped = x.reshape(num_groups, -1)  # (G, n)
    mean_abs = grouped.norm(p=1, dim=1).div(grouped.shape[1])
    threshold = (0.7 * mean_abs).view(-1, 1)
    positive = (grouped > threshold).type(x.type())
    negative = (grouped < -threshold).type(x.type())
    kept = (grouped.abs() > threshold).type(x.type())
    alpha = ((kept * grouped).abs().sum(dim=1) / kept.sum(dim=1)).view(-1, 1)
    out = alpha * positive - alpha * negative
    return out.reshape(x.shape).contiguous()


def quantize_binary(x: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Binary weights ``sign(x) * mean|x|`` per group."""
    grouped = x.reshape(num_groups, -1)  # (G, n)
    mean_abs = grouped.norm(p=1, dim=1, keepdim=True).div(grouped.shape[1])
    return grouped.sign().mul(mean_abs).reshape(x.shape).contiguous()


def quantize_weight(
    x: torch.Tensor,
    num_bits: int,
    quantization_type: str,
    num_groups: int,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight quantization at ``num_bits``: binary (1), ternary (2) or uniform (>= 3)."""
    if num_bits == 1:
        return quantize_binary(x, num_groups)
    if num_bits == 2:
        return quantize_ternary(x, num_groups)
    if quantization_type == SYMMETRIC:
        return quantize_symmetric(x, num_bits, num_groups, noise=noise)
    return quantize_asymmetric(x, num_bits, num_groups, noise=noise)


class _TopKMaskSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
        return topk_mask(scores, dense_ratio)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.clone(), None


class _WeightQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, num_bits: int, quantization_type: str, num_groups: int
    ) -> torch.Tensor:
        return quantize_weight(x, num_bits, quantization_type, num_groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.clone(), None, None, None


class _ActQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        num_bits: int,
        quantization_type: str,
        num_groups: int,
        x_min: torch.Tensor | None,
        x_max: torch.Tensor | None,
    ) -> torch.Tensor:
        if quantization_type == SYMMETRIC:
            return quantize_symmetric(x, num_bits, num_groups, x_min, x_max)
        return quantize_asymmetric(x, num_bits, num_groups, x_min, x_max)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        return grad.clone(), None, None, None, None, None


def topk_mask_ste(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """:func:`topk_mask` whose gradient flows straight to ``scores`` (learned masks)."""
    return _TopKMaskSTE.apply(scores, dense_ratio)


def quantize_weight_ste(
    x: torch.Tensor, num_bits: int, quantization_type: str, num_groups: int
) -> torch.Tensor:
    """:func:`quantize_weight` with an identity gradient."""
    return _WeightQuantSTE.apply(x, num_bits, quantization_type, num_groups)


def quantize_activation_ste(
    x: torch.Tensor,
    num_bits: int,
    quantization_type: str,
    num_groups: int = 1,
    x_min: torch.Tensor | None = None,
    x_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """Uniform activation quantization (dynamic per group, or static range) with an identity
    gradient."""
    return _ActQuantSTE.apply(x, num_bits, quantization_type, num_groups, x_min, x_max)
