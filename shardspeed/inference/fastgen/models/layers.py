"""Building blocks shared by the model families: RMSNorm, activations, soft-capping.

RoPE lives in :mod:`shardspeed.inference.fastgen.models.rope`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardspeed.inference.fastgen import cpu_fused


class RMSNorm(nn.Module):
    """RMS normalisation computed in fp32.

    ``offset=0`` (Llama): ``weight * (x / rms).to(dtype)``.
    ``offset=1`` (Gemma): ``((x / rms) * (1 + weight)).to(dtype)`` - the weight
    is stored as a delta from 1 and multiplied before the cast back.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusable(x):
            return cpu_fused.rms_norm(x, self.weight, self.eps, self.offset)
        return self._eager(x)

    def add_forward(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + a, norm(x + a))``, the residual sum rounded to the dtype as eager does."""
        if self._fusable(x) and self._fusable(a) and a.shape == x.shape:
            return cpu_fused.add_rms_norm(x, a, self.weight, self.eps, self.offset)
        s = x + a
        return s, self.forward(s)

    def _fusable(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.stride(-1) == 1
            and x.dtype == self.weight.dtype
            and cpu_fused.active(x)
        )

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``tanh(x / cap) * cap`` (Gemma 2 logit soft-capping); identity when ``cap`` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written out as HF's ``gelu_new`` does."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_accurate(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def _gelu_python(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# HF ``ACT2FN`` names -> the same math
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_python": _gelu_python,
    "gelu_new": gelu_new,
    "gelu_fast": _gelu_fast,
    "gelu_accurate": _gelu_accurate,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": _relu2,
    "relu6": F.relu6,
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "linear": lambda x: x,
}


def activation(name: str, field: str = "activation") -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation function by HF config name; ``ValueError`` names the config ``field``."""
    if name not in ACTIVATIONS:
        raise ValueError(
            f"config {field}={name!r} is not supported by the FastGen engine; supported: "
            f"{sorted(ACTIVATIONS)}. Use one of these or register a custom RaggedModel."
        )
    return ACTIVATIONS[name]
