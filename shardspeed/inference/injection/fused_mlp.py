"""Fused gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up in one matmul.

Built from a Llama-style MLP's ``gate_proj`` / ``up_proj`` / ``down_proj`` / ``act_fn``
(``nn.Linear`` or this rank's tensor-parallel shards: gate/up column-parallel on a
replicated input, down row-parallel, which keeps its all-reduce)::

    gate_up weight: (2 * inter, in) = cat(W_gate, W_up)          x: (B, T, in)
    gate, up = (x @ gate_up.T).split(inter)                      (B, T, inter) each
    y = down(act(gate) * up)                                     (B, T, out)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.inference.injection.fused_qkv import fuse_linears


class FusedGatedMLP(nn.Module):
    """A gated MLP whose gate and up projections share one matmul."""

    def __init__(
        self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn: nn.Module
    ) -> None:
        super().__init__()
        self.gate_up_weight, self.gate_up_bias, widths = fuse_linears([gate_proj, up_proj])
        self.inter_width = widths[0]
        if widths[0] != widths[1]:
            raise ValueError(f"gate and up projections differ in width: {widths}")
        self.down_proj = down_proj  # nn.Linear or RowParallelLinear (one all-reduce)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, in) -> gate_up: (B, T, 2 * inter)
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        gate, up = gate_up.split(self.inter_width, dim=-1)  # (B, T, inter) each
        return self.down_proj(self.act_fn(gate) * up)

    def extra_repr(self) -> str:
        return f"in={self.gate_up_weight.shape[1]}, inter={self.inter_width}"
