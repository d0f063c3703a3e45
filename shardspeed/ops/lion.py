"""Lion (Chen et al., 2023) and DeepSpeed's ``FusedLion`` / ``DeepSpeedCPULion`` on it.

Lion: sign-of-momentum updates with decoupled weight decay.

Per element, with gradient ``g`` and momentum ``m``::

    c = beta1 * m + (1 - beta1) * g          # interpolated direction
    p = p * (1 - lr * weight_decay)          # decoupled decay
    p = p - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

The update of each element depends only on that element, so Lion can run on a flat
1/N shard of concatenated parameters (see :func:`shardspeed.optim.is_elementwise`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from shardspeed.ops._validate import check_betas, check_non_negative


class Lion(Optimizer):
    """Lion optimizer with one momentum buffer per parameter.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate (Lion wants 3-10x smaller lr than AdamW).
        betas: ``(beta1, beta2)``: interpolation factor of the update direction and
            momentum decay. Default ``(0.9, 0.999)`` as DeepSpeed's ``FusedLion``
            (the paper recommends ``(0.9, 0.99)``).
        weight_decay: decoupled weight decay coefficient (multiplied by lr).
        foreach: use the multi-tensor ``torch._foreach_*`` kernels; ``None`` picks them
            whenever a group holds more than one tensor or lives on an accelerator.
        maximize: ascend instead of descend.
    """

    elementwise = True

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
    ) -> None:
        check_non_negative("Lion", "lr", lr)
        check_non_negative("Lion", "weight_decay", weight_decay)
        betas = check_betas("Lion", betas)
        defaults = dict(
            lr=lr, betas=betas, weight_decay=weight_decay, foreach=foreach, maximize=maximize
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one Lion update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = self._collect(group)
            if not params:
                continue
            use_foreach = group["foreach"]
            if use_foreach is None:
                use_foreach = len(params) > 1 or params[0].device.type != "cpu"
            update = _lion_foreach if use_foreach else _lion_single_tensor
            update(
                params,
                grads,
                exp_avgs,
                lr=float(group["lr"]),
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                weight_decay=group["weight_decay"],
                maximize=group["maximize"],
            )
        return loss

    def _collect(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        params, grads, exp_avgs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError(
                    "Lion does not support sparse gradients; use dense embeddings "
                    "(sparse=False) or torch.optim.SparseAdam for that parameter."
                )
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
        return params, grads, exp_avgs


class FusedLion(Lion):
    """Lion with DeepSpeed ``FusedLion``'s signature (multi-tensor foreach kernels)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


class DeepSpeedCPULion(Lion):
    """Lion for CPU-resident (offloaded) parameters, DeepSpeed ``DeepSpeedCPULion``'s signature.

    States take the parameters' dtype; ShardSpeed's offload passes fp32 master parameters,
    which is what ``fp32_optimizer_states=True`` asks for.
    """

    def __init__(
        self,
        model_params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states


def _lion_single_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    for p, grad, exp_avg in zip(params, grads, exp_avgs):
        if maximize:
            grad = -grad
        if weight_decay != 0.0:
            p.mul_(1.0 - lr * weight_decay)
        direction = exp_avg.lerp(grad, 1.0 - beta1).sign_()
        p.add_(direction, alpha=-lr)
        exp_avg.lerp_(grad, 1.0 - beta2)


def _lion_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    directions = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(directions)
    torch._foreach_add_(params, directions, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
