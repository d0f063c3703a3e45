"""DeepSpeed's gate output formats, for scripts that call the gating functions themselves.

:class:`~shardspeed.parallel.moe.gating.Routing` is what the MoE layer uses; DeepSpeed's
``top1gating`` / ``top2gating`` / ``topkgating`` (and ``TopKGate.forward``) return either
the dense GShard tensors ``(l_aux, combine_weights (S, E, C), dispatch_mask (S, E, C),
exp_counts)`` or, with ``sparse_routes=True``, ``(l_aux, capacity, E, indices (k, S),
locations (k, S), gates (k, S), exp_counts)``. Without token dropping the capacity is the
largest expert load on any rank of ``ep_group`` (an all-reduce max), bounded by the
number of tokens for top-1, as DeepSpeed agrees it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from shardspeed.parallel.moe.dispatch import agreed_capacity
from shardspeed.parallel.moe.gating import Routing, route_top1, route_top2, route_topk


def _capacity(routing: Routing, ep_group: Any) -> int:
    if routing.capacity is not None:
        return routing.capacity
    capacity = agreed_capacity(routing.exp_counts, ep_group)
    return min(capacity, routing.num_tokens) if routing.k == 1 else capacity


def dense_combine_weights(routing: Routing, capacity: int) -> Tensor:
    """(S, E, C) fp32: each kept route's weight at [token, expert, slot]; differentiable."""
    num_slots = routing.num_experts * capacity
    slot = torch.where(routing.kept, routing.expert_ids * capacity + routing.locations, num_slots)
    flat = routing.weights.new_zeros(routing.num_tokens, num_slots + 1)  # last column: dropped
    flat = flat.scatter_add(1, slot.t(), routing.weights.t())  # (S, E * C + 1)
    return flat[:, :num_slots].reshape(routing.num_tokens, routing.num_experts, capacity)


def deepspeed_gate_outputs(routing: Routing, ep_group: Any, *, sparse_routes: bool) -> tuple:
    """``routing`` in DeepSpeed's tuple layout (see the module docstring)."""
    capacity = _capacity(routing, ep_group)
    if sparse_routes:
        return (
            routing.l_aux,
            torch.tensor(capacity),
            routing.num_experts,
            routing.expert_ids.to(torch.int32),
            routing.locations.to(torch.int32),
            routing.weights,
            routing.exp_counts,
        )
    combine_weights = dense_combine_weights(routing, capacity)
    return routing.l_aux, combine_weights, combine_weights.bool(), routing.exp_counts


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: Any = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
) -> tuple:
    """DeepSpeed's ``top1gating`` (``use_tutel`` is accepted and ignored)."""
    routing = route_top1(
        logits,
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
        used_token=used_token,
        noisy_gate_policy=None if noisy_gate_policy == "None" else noisy_gate_policy,
        drop_tokens=drop_tokens,
        use_rts=use_rts,
    )
    return deepspeed_gate_outputs(routing, ep_group, sparse_routes=sparse_routes)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
) -> tuple:
    """DeepSpeed's ``top2gating`` (``logits`` is not modified in place)."""
    routing = route_top2(
        logits,
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
        drop_tokens=drop_tokens,
        second_expert_sampling=top2_2nd_expert_sampling,
    )
    return deepspeed_gate_outputs(routing, ep_group, sparse_routes=sparse_routes)


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
) -> tuple:
    """DeepSpeed's ``topkgating``: softmax, then top-k, renormalised over kept routes."""
    routing = route_topk(
        logits,
        k,
        capacity_factor=capacity_factor,
        min_capacity=min_capacity,
        drop_tokens=drop_tokens,
        drop_policy=drop_policy,
    )
    return deepspeed_gate_outputs(routing, ep_group, sparse_routes=sparse_routes)
