"""0/1 Adam (Lu et al., 2022, arXiv:2202.06009): DeepSpeed's ``ZeroOneAdam``.

Two phases, chosen by the step count ``t``:

```
variance phase  t <= var_freeze_step
  t % var_interval == 0:  g = all_reduce(g_local) / N (full precision); update m and v
  otherwise:              g = compressed_average(g_local); update m only
  p -= lr * wd * p ; p -= lr / bc1 * m / (sqrt(v / bc2) + eps)       same p on every rank
  var_interval doubles after every var_update_scaler variance updates

local phase     t > var_freeze_step (v frozen)
  m = beta1 m + (1 - beta1) g_local ; lrs += lr ; p -= lr * (m / denom + wd * p)   local
  every local_step_interval steps, synchronise:
    delta = (p - anchor) * denom               this rank's lr-weighted momentum sum
    delta = compressed_average(delta)
    m = -delta / lrs ; p = anchor + delta / denom ; anchor = p ; lrs = 0
  local_step_interval doubles every local_step_scaler steps, up to local_step_clipper
```

``anchor`` (the parameters at the last synchronisation, the same on every rank) replaces
DeepSpeed's ``momentum_accumulator``: the local update sum is ``p - anchor``, and after a
synchronisation every rank computes the same ``anchor + delta / denom``, so parameters are
bitwise equal again (DeepSpeed subtracted its accumulator, which leaves rank-dependent
rounding). Between synchronisations ``exp_avg`` and the parameters differ per rank: they are
part of :meth:`ZeroOneAdam.rank_local_state`.

Differences from DeepSpeed 0.19.6 as in :mod:`shardspeed.optim.onebit.adam` (no dummy first
step, ``bias_correction`` honoured, ``exp_avg_mask`` refused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from shardspeed.optim.onebit.common import (
    Key,
    OnebitOptimizer,
    adam_direction,
    apply_adam_update,
)


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam with DeepSpeed's ``ZeroOneAdam`` arguments.

    Args:
        params, lr, betas, eps, weight_decay, bias_correction, eps_inside_sqrt, amsgrad,
            cuda_aware, comm_backend_name, comm_group: as :class:`~shardspeed.optim.onebit.adam.OnebitAdam`.
        var_freeze_step: the last step that may update the variance.
        var_update_scaler: variance updates between doublings of the variance interval.
        local_step_scaler: steps between doublings of the local-step interval.
        local_step_clipper: the largest local-step interval.
    """

    _title = "ZeroOneAdam"
    elementwise = True  # restated: is_elementwise reads the class body only

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        comm_group: Any = None,
    ) -> None:
        for name, value, low in (
            ("var_freeze_step", var_freeze_step, 0),
            ("var_update_scaler", var_update_scaler, 1),
            ("local_step_scaler", local_step_scaler, 1),
            ("local_step_clipper", local_step_clipper, 1),
        ):
            if int(value) < low:
                raise ValueError(f"ZeroOneAdam: {name}={value!r} must be an integer >= {low}.")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
        )
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
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
                state.update(
                    step=0,
                    variance_steps=0,
                    var_interval=1,
                    var_counter=0,
                    local_step_interval=1,
                    local_step_counter=0,
                    lrs=0.0,
                    exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format),
                )
            state["step"] += 1
            if state["step"] <= self.var_freeze_step:
                self._variance_phase_step(key, group, p, state)
            else:
                self._local_phase_step(key, group, p, state)
        return loss

    def _direction(
        self, state: dict[str, Any], group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        return adam_direction(
            state["exp_avg"],
            state["exp_avg_sq"],
            group,
            momentum_steps=state["step"],
            variance_steps=max(state["variance_steps"], 1),
        )

    def _variance_phase_step(
        self, key: Key, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]
    ) -> None:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if state["step"] % state["var_interval"] == 0:
            grad = self.average_(p.grad)
            exp_avg.lerp_(grad, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            state["variance_steps"] += 1
            state["var_counter"] += 1
            if state["var_counter"] == self.var_update_scaler:
                state["var_counter"] = 0
                state["var_interval"] *= 2
        else:
            exp_avg.lerp_(self.compressed_average(key, p.grad), 1.0 - beta1)
        denom, step_size = self._direction(state, group)
        apply_adam_update(p, exp_avg, denom, step_size, group)

    def _local_phase_step(
        self, key: Key, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]
    ) -> None:
        beta1 = group["betas"][0]
        exp_avg = state["exp_avg"]
        if "anchor" not in state:  # parameters at the last synchronisation (every rank equal)
            state["anchor"] = p.detach().clone()
            self._errors.pop(key, None)  # the local phase starts with fresh errors
        exp_avg.mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
        state["lrs"] += group["lr"]
        denom, step_size = self._direction(state, group)
        apply_adam_update(p, exp_avg, denom, step_size, group)
        if state["step"] % state["local_step_interval"] == 0:
            # bc1 * denom turns the local update sum back into an lr-weighted momentum sum
            bc1 = 1.0 - beta1 ** state["step"] if group["bias_correction"] else 1.0
            anchor = state["anchor"]
            delta = (p - anchor).mul_(denom).mul_(bc1)  # (numel,) this rank's
            delta = self.compressed_average(key, delta)  # (numel,) the same on every rank
            if state["lrs"] > 0:
                exp_avg.copy_(delta).div_(-state["lrs"])
            p.copy_(anchor).addcdiv_(delta, denom, value=1.0 / bc1)
            anchor.copy_(p)
            state["lrs"] = 0.0
        state["local_step_counter"] += 1
        if state["local_step_counter"] == self.local_step_scaler:
            state["local_step_counter"] = 0
            state["local_step_interval"] = min(
                self.local_step_clipper, state["local_step_interval"] * 2
            )

    # -- rank-local state ---------------------------------------------------------------
    def rank_local_state(self) -> dict[str, torch.Tensor]:
        """Errors, plus (in the local phase) this rank's momentum and parameters."""
        out = super().rank_local_state()
        for (gi, pi), p in self._keys():
            state = self.state.get(p, {})
            if "anchor" in state:
                out[f"g{gi}.m{pi}.exp_avg"] = state["exp_avg"]
                out[f"g{gi}.m{pi}.params"] = p.detach()
        return out

    def load_rank_local_state(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        super().load_rank_local_state(tensors)
        tensors = dict(tensors or {})
        for (gi, pi), p in self._keys():
            state = self.state.get(p, {})
            exp_avg = tensors.get(f"g{gi}.m{pi}.exp_avg")
            params = tensors.get(f"g{gi}.m{pi}.params")
            if "anchor" not in state or exp_avg is None or params is None:
                continue
            if exp_avg.numel() != p.numel() or params.numel() != p.numel():
                continue  # saved with another layout: keep the shared (rank 0) values
            with torch.no_grad():
                state["exp_avg"].view(-1).copy_(exp_avg.reshape(-1))
                p.view(-1).copy_(params.reshape(-1))
