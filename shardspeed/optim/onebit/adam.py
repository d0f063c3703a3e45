"""1-bit Adam (Tang et al., 2021, arXiv:2102.02888): DeepSpeed's ``OneBitAdam``.

Two stages, chosen by the step count ``t``:

```
warm-up      t <= freeze_step   g = all_reduce(g_local) / N            full precision
                                m = beta1 m + (1 - beta1) g ; v = beta2 v + (1 - beta2) g^2
compression  t >  freeze_step   m = beta1 m + (1 - beta1) g_local      this rank's momentum
                                m = compressed_average(m)              1 bit per element
                                v frozen
update       p -= lr * wd * p ; p -= lr / bc1 * m / (sqrt(v / bc2) + eps)
```

Adam's variance stabilises early, so after ``freeze_step`` it is frozen and the update is
linear in the momentum: averaging the momenta (compressed, with error feedback) replaces
averaging the gradients. After the compressed average every rank holds the same momentum,
so parameters stay identical on every rank. A param group with ``non_freeze: true`` always
takes the warm-up path.

Differences from DeepSpeed 0.19.6 (which removed it in 0.19.7): there is no dummy first
step (DeepSpeed's first ``step()`` only initialised its cupy buffers), so warm-up is exactly
``freeze_step`` Adam steps; ``bias_correction`` is honoured (DeepSpeed accepted and ignored
it: set it false for DeepSpeed's numerics); ``exp_avg_mask`` is refused (it is per
parameter, the engine steps flat buckets).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed.optim.onebit.common import OnebitOptimizer, adam_direction, apply_adam_update


class OnebitAdam(OnebitOptimizer):
    """1-bit Adam with DeepSpeed's ``OneBitAdam`` arguments.

    Args:
        params: parameters or parameter-group dicts (the engine passes its flat masters).
        lr, betas, eps, weight_decay: as Adam; weight decay is decoupled (as DeepSpeed's).
        freeze_step: full-precision Adam steps before compression starts.
        bias_correction: divide the moments by ``1 - beta**k``.
        eps_inside_sqrt: ``sqrt(v_hat + eps)`` instead of ``sqrt(v_hat) + eps``.
        amsgrad: must be false.
        cuda_aware, comm_backend_name: DeepSpeed's communication knobs, accepted; every
            backend runs the same collectives through ``torch.distributed``.
        comm_group: the data-parallel group (None: every rank).
    """

    _title = "OneBitAdam"
    elementwise = True  # restated: is_elementwise reads the class body only

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        comm_group: Any = None,
    ) -> None:
        if int(freeze_step) < 0:
            raise ValueError(f"OneBitAdam: freeze_step={freeze_step!r} must be >= 0.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
        )
        self.freeze_step = int(freeze_step)
        super().__init__(
            params,
            defaults,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            comm_group=comm_group,
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_replicated()
        for key, group, p in list(self.masters()):
            state = self.state_of(key, p)
            if not state:
                state["step"] = 0
                state["variance_steps"] = 0  # updates v received (frozen after warm-up)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            beta1, beta2 = group["betas"]
            if state["step"] <= self.freeze_step or group.get("non_freeze", False):
                grad = self.average_(p.grad)
                exp_avg.lerp_(grad, 1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                state["variance_steps"] += 1
            else:
                exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg.copy_(self.compressed_average(key, exp_avg))
            denom, step_size = adam_direction(
                exp_avg,
                exp_avg_sq,
                group,
                momentum_steps=state["step"],
                variance_steps=max(state["variance_steps"], 1),
            )
            apply_adam_update(p, exp_avg, denom, step_size, group)
        return loss

    def in_compression(self) -> bool:
        """True once the steps run the compressed momentum all-reduce."""
        steps = [s["step"] for s in self.state.values() if "step" in s]
        return bool(steps) and max(steps) >= self.freeze_step
