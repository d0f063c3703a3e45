"""The decoder's MLP blocks: the gated MLP and the top-k routed mixture of gated experts.

:class:`SparseMoE` covers the three routed families FastGen serves:

* Mixtral: softmax (fp32) -> top-k -> renormalise the k weights;
* Qwen3-MoE: the same, renormalising only when ``norm_topk_prob``;
* Qwen2-MoE (and DeepSeek-style shared + routed): plus a shared expert that every
  token goes through, scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE) or not
  (no gate), added after the routed experts.

Expert placement: the block holds the experts of ``local_experts`` only (all of
them on one process), keyed by their *global* id so that parameter names
(``mlp.experts.{e}.gate_up_proj.weight``) are the same on every rank. With more than
one expert-parallel rank an ``exchange`` (see
:mod:`shardspeed.inference.fastgen.expert_parallel.dispatch`) moves the routed
tokens to the ranks holding their experts and the results back; this module
never touches ``torch.distributed``.

Numerics: every expert runs on its tokens in token order and each token's
outputs are summed in ascending expert order, so an expert-parallel rank computes
the same values as the single-process block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardspeed.inference.fastgen import cpu_fused
from shardspeed.inference.fastgen.models.layers import activation

# (block, x [N, hidden], expert ids [N, k], weights [N, k] fp32) -> routed + shared output
MoEExchange = Callable[["SparseMoE", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int, act: str, act_field: str, bias: bool):
        super().__init__()
        self.intermediate = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act, act_field)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [N, 2 * inter]
        if self.act is F.silu and gate_up.dim() == 2 and cpu_fused.active(gate_up):
            return self.down_proj(cpu_fused.silu_mul(gate_up))  # one pass, eager's bits
        gate, up = gate_up.chunk(2, dim=-1)  # each [N, inter]
        return self.down_proj(self.act(gate) * up)


@dataclass(frozen=True)
class MoESpec:
    """The routed block of one layer, resolved from an HF config."""

    num_experts: int
    top_k: int
    expert_inter: int  # this rank's rows of each expert's MLP (tensor parallelism)
    norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1
    shared_inter: int = 0  # this rank's rows of the shared expert; 0 => none
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales it


class SparseMoE(nn.Module):
    """Top-k routed experts (+ an optional shared expert) on the experts of this rank.

    Under tensor parallelism each expert (and the shared expert) holds this rank's
    rows and the output is a partial sum; the router is replicated.
    """

    def __init__(
        self,
        hidden: int,
        spec: MoESpec,
        act: str,
        act_field: str,
        local_experts: range | None = None,
    ):
        super().__init__()
        self.spec = spec
        self.top_k = spec.top_k
        self.num_experts = spec.num_experts
        self.local_experts = range(spec.num_experts) if local_experts is None else local_experts
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.experts = nn.ModuleDict(
            {
                str(e): GatedMLP(hidden, spec.expert_inter, act, act_field, False)
                for e in self.local_experts
            }
        )
        self.shared_expert = (
            GatedMLP(hidden, spec.shared_inter, act, act_field, False)
            if spec.shared_inter
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(hidden, 1, bias=False) if spec.shared_inter and spec.shared_gate else None
        )
        self.exchange: MoEExchange | None = None  # set for more than one expert-parallel rank

    def keep_experts(self, local_experts: range) -> None:
        """Drop every expert outside ``local_experts`` (expert parallelism; before load)."""
        for key in [k for k in self.experts if int(k) not in local_experts]:
            del self.experts[key]
        self.local_experts = local_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[N, k]`` fp32, expert ids ``[N, k]``) of every token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [N, k] each
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def run_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` (held here) on ``rows`` ``[T_e, hidden]``."""
        return self.experts[str(e)](rows)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's (gated) output on ``x``, or None without one."""
        if self.shared_expert is None:
            return None
        out = self.shared_expert(x)  # [N, hidden]
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(x)) * out
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.exchange is not None:
            return self.exchange(self, x, experts, weights)
        out = torch.zeros_like(x)  # [N, hidden]
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)  # tokens routed to e, and at which rank
            y = self.run_expert(e, x[token]) * weights[token, slot, None]  # [T_e, hidden]
            out.index_add_(0, token, y.to(out.dtype))
        shared = self.shared(x)
        return out if shared is None else out + shared
