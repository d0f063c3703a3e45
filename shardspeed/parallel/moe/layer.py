"""The MoE layer: DeepSpeed's ``MoE`` / ``MOELayer`` on a gate, experts and a dispatch.

::

    MoE.forward(hidden (..., M), used_token=None)
      tokens = hidden.reshape(-1, M)                       (S, M)
      routing = gate.route(tokens, used_token)             who goes where (gating.py)
      out = dispatch(tokens, routing, experts)             all-to-all, experts, back (dispatch.py)
      [use_residual] out = out * c0 + mlp(hidden) * c1     c = softmax(coefficient(hidden))
      return out.reshape(hidden.shape), l_aux, exp_counts

Module and parameter names are DeepSpeed's (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<local id>.*``, ``mlp``, ``coefficient``) so
checkpoints and ``state_dict`` keys line up, and construction draws from the random
generator in DeepSpeed's order (experts are copies; then the gate; then the coefficient).

Expert groups: the layer builds them itself from ``ep_size`` (see ``groups.py``), at
construction when ``torch.distributed`` is initialised, else on ``set_deepspeed_parallelism()``
or the first forward. Without ``torch.distributed`` only ``ep_size=1`` runs.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from shardspeed import comm
from shardspeed.parallel.moe.dispatch import make_dispatch
from shardspeed.parallel.moe.experts import Experts
from shardspeed.parallel.moe.gating import NOISY_GATE_POLICIES, TopKGate
from shardspeed.parallel.moe.groups import expert_group_name, topology_for
from shardspeed.utils.logging import get_logger, warning_once

logger = get_logger(__name__)


class MOELayer(nn.Module):
    """Gate + experts + dispatch for one layer; ``forward`` sets ``l_aux`` and ``exp_counts``."""

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False  # Tutel kernels are not used; the flag is accepted
        self.wall_clock_breakdown = False
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self._dispatch = make_dispatch(gate.drop_tokens, None, ep_size, num_local_experts)

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)
        self._dispatch = make_dispatch(
            self.gate.drop_tokens, ep_group, self.ep_size, self.num_local_experts
        )

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MOELayer(ep_size={self.ep_size}) has no expert-parallel group; build it "
                "through MoE (which creates the groups) or call _set_ep_group(group)."
            )
        tokens = hidden.reshape(-1, hidden.shape[-1])  # (S, M)
        routing = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        out = self._dispatch(tokens, routing, self.experts)  # (S, M)
        return out.reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``: same arguments, same outputs.

    ``forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)``. ``k`` may
    be above 2 (softmax-then-top-k routing); ``use_tutel`` is accepted and ignored;
    ``enable_expert_tensor_parallelism`` has no effect while the job has no tensor
    parallelism (the expert groups are built with tp = 1).
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        _check_arguments(num_experts, ep_size, k, noisy_gate_policy)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        if use_tutel:
            warning_once("MoE(use_tutel=True): Tutel is not used; the standard dispatch runs.")
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling,
        )  # fmt: skip
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)  # mixes expert and dense outputs
        logger.debug(
            "MoE layer: %d experts, %d local, ep_size %d, k %d",
            num_experts, self.num_local_experts, ep_size, k,
        )  # fmt: skip
        if comm.is_initialized():
            self.set_deepspeed_parallelism()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Attach this layer to its expert groups (creating them once per ``ep_size``)."""
        if use_data_before_expert_parallel_:
            raise ValueError(
                "MoE: use_data_before_expert_parallel_=True (DeepSpeed's 'D + E' rank "
                "order) is not supported; expert groups follow the topology's 'E + D' "
                "order (experts on consecutive data ranks). Leave it False."
            )
        if self.deepspeed_moe.ep_group is not None:
            return
        topology = topology_for(self.ep_size)
        self.deepspeed_moe._set_ep_group(topology.group("expert"))

    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.deepspeed_moe.ep_group is None and (self.ep_size > 1 or comm.is_initialized()):
            self.set_deepspeed_parallelism()  # raises a clear error without torch.distributed
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)  # (..., 2)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _check_arguments(num_experts: int, ep_size: int, k: int, noisy_gate_policy: Any) -> None:
    if not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"MoE(ep_size={ep_size!r}): ep_size must be an int >= 1.")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % ep_size:
        raise ValueError(
            f"MoE(num_experts={num_experts!r}, ep_size={ep_size}): num_experts must be a "
            f"positive multiple of ep_size (each of the {ep_size} expert-parallel ranks holds "
            "num_experts // ep_size experts)."
        )
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"MoE(k={k!r}): k must be an int in [1, num_experts={num_experts}].")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(
            f"MoE(noisy_gate_policy={noisy_gate_policy!r}): valid values are "
            f"{list(NOISY_GATE_POLICIES)}."
        )
