"""Gating: which experts each token goes to, with what weight, and which tokens are dropped.

The routing functions are local math on one rank's logits; the only communication a
gate ever needs (the no-drop capacity agreed across the expert group) lives in
:mod:`~shardspeed.parallel.moe.dispatch`. Semantics follow DeepSpeed 0.19.8's
``sharded_moe`` (GShard / Switch gating), term by term:

==============  ========================================================================
capacity        ``ceil(S / E * capacity_factor * k)`` in float32 arithmetic (as DeepSpeed
                computes it, so 25 tokens / 2 experts * 1.2 gives 16, not 15), at least
                ``min_capacity``; per expert, per rank
top-1           argmax of softmax(logits) (of logits + Gumbel noise with ``RSample``);
                the combine weight is the raw softmax probability
RTS             Random Token Selection: with ``use_rts`` the tokens an over-full expert
                keeps are the ``capacity`` with the highest uniform(0, 1) priority;
                without it they are whichever ``torch.topk`` picks among equal 0/1 keys
                (DeepSpeed's rule: implementation-defined, not token order)
top-2           first = argmax; second = argmax of logits (+ Gumbel noise when
                ``top2_2nd_expert_sampling``) with the first masked out; capacity slots
                go to every first choice in token order, then every second choice;
                weights renormalised over the routes that were kept
top-k (k > 2)   softmax over all experts, then top-k (the Mixtral / DeepSeek router,
                DeepSpeed's ``topkgating``); when dropping, an expert keeps the tokens
                with the highest gate probability; weights renormalised over kept routes
l_aux           ``E * sum_e mean_s(gates[s, e]) * mean_s(first_choice[s, e])`` for
                k = 1 and 2; top-k uses every chosen route and divides by k
exp_counts      routes per expert before any dropping, on this rank
noise           ``Jitter``: the gate input times uniform(0.99, 1.01) (training only);
                ``RSample``: Gumbel noise on the top-1 logits (training only)
==============  ========================================================================

Random draws happen in DeepSpeed's order (jitter, Gumbel, RTS), from torch's default
generator, so the same seed routes the same way as DeepSpeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
TOPK_DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class Routing:
    """Where each (route, token) pair goes. Route-major: route ``r`` of token ``s`` is ``[r, s]``.

    A dropped route has expert id -1, location 0 and weight 0.
    """

    expert_ids: Tensor  # (k, S) int64 global expert id, -1 = dropped
    locations: Tensor  # (k, S) int64 slot in the expert's buffer, in token order
    weights: Tensor  # (k, S) fp32 combine weight, differentiable w.r.t. the gate
    exp_counts: Tensor  # (E,) int64 routes per expert before dropping (this rank)
    l_aux: Tensor  # () fp32 load-balancing loss
    capacity: int | None  # slots per expert when dropping; None: nothing is dropped
    num_experts: int

    @property
    def k(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def kept(self) -> Tensor:
        """(k, S) bool: routes that reach an expert."""
        return self.expert_ids >= 0


def expert_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int
) -> int:
    """Slots per expert: ``ceil(num_tokens / num_experts * capacity_factor)``, >= min_capacity.

    The product is rounded to float32 before the ceiling, as DeepSpeed computes it with a
    float32 tensor; pass ``capacity_factor * k`` for top-k gating.
    """
    ratio = torch.tensor(num_tokens / num_experts, dtype=torch.float32)
    factor = torch.tensor(capacity_factor, dtype=torch.float32)
    return max(math.ceil((ratio * factor).item()), int(min_capacity))


def multiplicative_jitter(x: Tensor, device: Any = None, epsilon: float = 1e-2) -> Tensor:
    """``x`` times uniform(1 - epsilon, 1 + epsilon) noise (the ``Jitter`` gate policy)."""
    if epsilon == 0:
        return x
    device = x.device if device is None else device
    low = torch.tensor(1.0 - epsilon, device=device)
    high = torch.tensor(1.0 + epsilon, device=device)
    return x * torch.distributions.Uniform(low, high).rsample(x.shape)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: Any = None) -> Tensor:
    """Standard Gumbel(0, 1) noise of ``shape`` (for ``RSample`` and top-2 sampling)."""
    zero = torch.tensor(0.0, device=device)
    one = torch.tensor(1.0, device=device)
    return torch.distributions.Gumbel(zero, one).rsample(shape)


def _check_min_capacity(num_tokens: int, min_capacity: int) -> None:
    if num_tokens < min_capacity:
        raise ValueError(
            f"top-1 gating got {num_tokens} tokens but min_capacity={min_capacity}; the "
            "number of tokens per rank (batch x sequence) must be >= min_capacity. Lower "
            "min_capacity (0 is allowed) or raise the micro-batch size."
        )


def _routing_from_masks(
    masks: list[Tensor],
    locations: list[Tensor],
    weights: list[Tensor],
    exp_counts: Tensor,
    l_aux: Tensor,
    capacity: int | None,
) -> Routing:
    """Collapse per-route one-hot (S, E) masks into (k, S) ids / locations / weights."""
    num_experts = masks[0].shape[1]
    ids, locs = [], []
    for mask, loc in zip(masks, locations):
        kept = mask.sum(dim=1) > 0  # (S,)
        ids.append(torch.where(kept, mask.argmax(dim=1), -1))
        locs.append((loc * mask).sum(dim=1))
    return Routing(
        torch.stack(ids),
        torch.stack(locs),
        torch.stack(weights),
        exp_counts,
        l_aux,
        capacity,
        num_experts,
    )


def route_top1(
    logits: Tensor,
    *,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> Routing:
    """Top-1 (Switch) routing of ``logits`` (S, E) fp32; ``used_token`` (S,) masks tokens out."""
    num_tokens, num_experts = logits.shape
    noisy = None
    if noisy_gate_policy == "RSample":
        noisy = logits + gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)  # (S, E)
    choice = torch.argmax(gates if noisy is None else noisy, dim=1)  # (S,)
    mask = F.one_hot(choice, num_classes=num_experts)  # (S, E) int64
    if used_token is not None:
        mask = mask * used_token.to(mask.dtype).unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    priority = mask * torch.rand(mask.shape, device=logits.device) if use_rts else mask
    _check_min_capacity(num_tokens, min_capacity)
    capacity = None
    if drop_tokens:
        capacity = expert_capacity(num_tokens, num_experts, capacity_factor, min_capacity)
        keep = torch.topk(priority, k=min(capacity, num_tokens), dim=0).indices  # (C', E)
        mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    locations = torch.cumsum(mask, dim=0) - 1  # (S, E) slot of each token in its expert
    weight = (gates * mask).sum(dim=1)  # (S,) raw probability, 0 when dropped
    return _routing_from_masks([mask], [locations], [weight], exp_counts, l_aux, capacity)


def route_top2(
    logits: Tensor,
    *,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    second_expert_sampling: bool = True,
) -> Routing:
    """Top-2 (GShard) routing of ``logits`` (S, E) fp32."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)  # (S, E)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)  # (S, E)
    if second_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, device=logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)  # (S, E)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    # second choices queue behind every first choice of the same expert
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts**2
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    capacity = None
    if drop_tokens:
        capacity = expert_capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < capacity)
        mask2 = mask2 * (locations2 < capacity)
    gate1 = (gates * mask1).sum(dim=1)  # (S,)
    gate2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    return _routing_from_masks(
        [mask1, mask2],
        [locations1, locations2],
        [gate1 / denom, gate2 / denom],
        exp_counts,
        l_aux,
        capacity,
    )


def route_topk(
    logits: Tensor,
    k: int,
    *,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    drop_policy: str = "probs",
) -> Routing:
    """Softmax-then-top-k routing (Mixtral / DeepSeek style) of ``logits`` (S, E) fp32.

    ``drop_policy``: ``"probs"`` keeps an over-full expert's highest-probability tokens,
    ``"position"`` its earliest tokens.
    """
    if drop_policy not in TOPK_DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r}; valid: {list(TOPK_DROP_POLICIES)}")
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)  # (S, E)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)  # (S, k), descending
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)  # (S, E)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts**2 / k
    capacity = None
    if drop_tokens:
        capacity = expert_capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            chosen = torch.zeros_like(gates).scatter(1, top_idx, top_gate)  # (S, E)
            n_keep = min(capacity, num_tokens)
            keep = torch.topk(chosen, k=n_keep, dim=0, sorted=False).indices
            mask &= torch.zeros_like(mask).scatter_(0, keep, True)
        else:
            mask &= (torch.cumsum(mask, dim=0) - 1) < capacity
    locations = torch.cumsum(mask, dim=0) - 1  # (S, E)
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    kept = mask.gather(1, top_idx)  # (S, k)
    return Routing(
        torch.where(kept, top_idx, -1).t().contiguous(),
        (locations.gather(1, top_idx) * kept).t().contiguous(),
        masked.gather(1, top_idx).t().contiguous(),
        exp_counts,
        l_aux,
        capacity,
        num_experts,
    )


class TopKGate(nn.Module):
    """The router: a bias-free linear map to expert logits, then top-1 / top-2 / top-k.

    DeepSpeed's constructor; :meth:`route` returns a :class:`Routing` (what
    :class:`~shardspeed.parallel.moe.layer.MOELayer` uses), :meth:`forward` returns
    DeepSpeed's tuples for scripts that call the gate themselves.
    """

    wg: nn.Linear

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Any = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(
                f"TopKGate(k={k!r}): k must be an int in [1, num_experts={num_experts}]."
            )
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r}; valid: {list(NOISY_GATE_POLICIES)}."
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None and self.ep_group is not ep_group:
            raise RuntimeError("TopKGate already has an expert-parallel group.")
        self.ep_group = ep_group

    def route(self, tokens: Tensor, used_token: Tensor | None = None) -> Routing:
        """Route ``tokens`` (S, M); ``used_token`` (S,) masks tokens out (top-1 only)."""
        x = tokens.float()  # gating runs in fp32 whatever the model dtype
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=x.device)
        logits = F.linear(x, self.wg.weight.float())  # (S, E)
        capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
        common = {"capacity_factor": capacity_factor, "min_capacity": self.min_capacity}
        if self.k == 1:
            return route_top1(
                logits,
                used_token=used_token,
                noisy_gate_policy=self.noisy_gate_policy if self.training else None,
                drop_tokens=self.drop_tokens,
                use_rts=self.use_rts,
                **common,
            )
        if self.k == 2:
            return route_top2(
                logits,
                drop_tokens=self.drop_tokens,
                second_expert_sampling=self.top2_2nd_expert_sampling,
                **common,
            )
        return route_topk(logits, self.k, drop_tokens=self.drop_tokens, **common)

    def forward(
        self,
        input: Tensor,
        used_token: Tensor | None = None,
        sparse_routes: bool = False,
        use_tutel: bool = False,
    ) -> tuple[Any, ...]:
        """DeepSpeed's gate outputs: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``,
        or with ``sparse_routes`` ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``."""
        from shardspeed.parallel.moe.ds_format import deepspeed_gate_outputs

        routing = self.route(input, used_token)
        return deepspeed_gate_outputs(routing, self.ep_group, sparse_routes=sparse_routes)
