"""Building blocks shared by the model families: RMSNorm, RoPE, activations."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in fp32 like HF Llama."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either the new ``rope_parameters`` or old ``rope_theta/rope_scaling`` keys."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any], max_positions: int | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` for rope types default, linear and llama3."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params.get("original_max_position_embeddings") or max_positions)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"config rope type {rope_type!r} is not supported by the FastGen engine; supported: "
        "'default', 'linear', 'llama3'."
    )


class RotaryEmbedding(nn.Module):
    """``cos``/``sin`` per token position, ``[N, head_dim]`` (half-rotation layout)."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_positions: int | None):
        super().__init__()
        self.inv_freq_cpu = rope_inv_freq(
            head_dim, params, max_positions
        )  # not a buffer: survives meta init

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq_cpu.to(positions.device)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, D]`` by per-token ``cos``/``sin`` ``[N, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [N, heads, D]
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written out as HF's ``gelu_new`` does."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


def activation(name: str):
    """Activation function by HF config name."""
    table = {
        "gelu_new": gelu_new,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu": F.gelu,
        "relu": F.relu,
        "silu": F.silu,
        "swish": F.silu,
    }
    if name not in table:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(table)}.")
    return table[name]
