"""Fused QKV projection: one matmul against the concatenated ``[q | k | v]`` weight.

Built from a layer's separate ``q_proj`` / ``k_proj`` / ``v_proj`` (``nn.Linear`` or this
rank's :class:`~shardspeed.parallel.tensor.layers.ColumnParallelLinear` shards: their forward
is a plain ``F.linear`` on a replicated input, so concatenating the local weights gives the
same numbers)::

    weight: (q_out + k_out + v_out, in) = cat(W_q, W_k, W_v)     x: (B, T, in)
    y = x @ weight.T + bias                                      y: (B, T, q_out + k_out + v_out)
    q, k, v = y.split((q_out, k_out, v_out), dim=-1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear_parts(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight (out, in), bias)`` of an ``nn.Linear`` or a column-parallel shard of one."""
    weight = module.linear_weight() if hasattr(module, "linear_weight") else module.weight
    if getattr(module, "gather_output", False):
        raise ValueError(
            f"kernel injection cannot fuse {type(module).__name__} with gather_output=True "
            "(its output is all-gathered); only rank-local column shards fuse."
        )
    if weight.dim() != 2:
        raise ValueError(f"kernel injection expects a 2-D linear weight, got {tuple(weight.shape)}")
    return weight.detach(), (None if module.bias is None else module.bias.detach())


def fuse_linears(modules: list[nn.Module]) -> tuple[nn.Parameter, nn.Parameter | None, list[int]]:
    """Concatenate linear layers on their output features; returns weight, bias, widths."""
    parts = [linear_parts(m) for m in modules]
    weight = torch.cat([w for w, _ in parts], dim=0)  # (sum out, in)
    widths = [w.shape[0] for w, _ in parts]
    bias = None
    if any(b is not None for _, b in parts):
        bias = torch.cat(
            [b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts]
        )  # (sum out,)
    requires_grad = False  # inference modules
    return (
        nn.Parameter(weight, requires_grad=requires_grad),
        None if bias is None else nn.Parameter(bias, requires_grad=requires_grad),
        widths,
    )


class FusedQKV(nn.Module):
    """``q, k, v = FusedQKV(q_proj, k_proj, v_proj)(x)`` with a single matmul."""

    def __init__(self, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module) -> None:
        super().__init__()
        self.weight, self.bias, widths = fuse_linears([q_proj, k_proj, v_proj])
        self.q_width, self.k_width, self.v_width = widths

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: (B, T, in) -> qkv: (B, T, q_width + k_width + v_width)
        qkv = F.linear(x, self.weight, self.bias)
        q, k, v = qkv.split((self.q_width, self.k_width, self.v_width), dim=-1)
        return q, k, v

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, q={self.q_width}, k={self.k_width}, v={self.v_width}"
