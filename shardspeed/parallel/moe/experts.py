"""The experts of one MoE layer held by this rank.

Each local expert is a deep copy of the expert module the user passed (no random draws),
so a script seeded like its DeepSpeed run starts from the same weights. Expert
parameters carry DeepSpeed's marks, which the engine and
:func:`~shardspeed.parallel.moe.utils.split_params_into_different_moe_groups_for_optimizer`
read:

* ``param.allreduce = False``: not reduced over the ``data`` axis;
* ``param.group_name = "ep_size_<ep>"``: reduced over the ``expert_data`` axis of
  :func:`shardspeed.parallel.moe.groups.topology_for` ``(ep)``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class Experts(nn.Module):
    """``num_local_experts`` copies of ``expert`` in ``deepspeed_experts`` (DeepSpeed's name)."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        for local_expert in self.deepspeed_experts:
            for param in local_expert.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
                param.group_name = expert_group_name  # type: ignore[attr-defined]

    def run_expert(self, index: int, tokens: Tensor) -> Tensor:
        """Local expert ``index`` on ``tokens`` (..., M); a tuple output's first item."""
        out = self.deepspeed_experts[index](tokens)
        return out[0] if isinstance(out, tuple) else out

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs`` (ep, L, C, M): expert ``l`` gets ``inputs[:, l:l+1]``; same layout out."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        return torch.cat([self.run_expert(i, c) for i, c in enumerate(chunks)], dim=1)
