"""DeepSpeed-compatible Adam classes.

``from shardspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam`` works where user code
imported them from ``deepspeed.ops.adam``. Both subclass ``torch.optim.Adam`` and keep its
state layout. ``FusedAdam`` runs torch's fused kernel (``fused=True`` on CUDA and on CPU,
where it measured 6x faster than foreach). ``DeepSpeedCPUAdam`` steps fp32 CPU parameters
with ShardSpeed's native kernel (:mod:`shardspeed.ops.cpu_adam`, JIT-built on first use),
which beats torch's fused CPU Adam on in-cache shards; see ``docs/optimizers.md``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from shardspeed.ops.cpu_adam import ENV_VAR, Backend, adam_step_, select_backend
from shardspeed.ops.kernels import default_kernel_flags, materialize, param_tensors
from shardspeed.utils.logging import info_once

_HAS_DECOUPLED_FLAG = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters


def _adam_kwargs(
    owner: str, params: list[Any], decoupled: bool, bias_correction: bool
) -> dict[str, Any]:
    if not bias_correction:
        raise ValueError(
            f"{owner}: bias_correction=False is not supported (torch's Adam kernels always "
            "bias-correct). Fix: drop the argument."
        )
    if decoupled and not _HAS_DECOUPLED_FLAG:
        raise RuntimeError(
            f"{owner}: this torch {torch.__version__} has no Adam(decoupled_weight_decay=...); "
            "upgrade torch, or use torch.optim.AdamW directly."
        )
    flags: dict[str, Any] = default_kernel_flags(torch.optim.Adam, param_tensors(params))
    if _HAS_DECOUPLED_FLAG:
        flags["decoupled_weight_decay"] = decoupled
    return flags


class FusedAdam(torch.optim.Adam):
    """Adam/AdamW with DeepSpeed ``FusedAdam``'s signature.

    ``adam_w_mode=True`` (default) applies decoupled weight decay (AdamW); ``False`` adds
    ``weight_decay * p`` to the gradient (Adam with L2). ``set_grad_none`` is the default of
    :meth:`zero_grad`. Unlike DeepSpeed, ``amsgrad=True`` is supported.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        params = materialize(params)
        flags = _adam_kwargs("FusedAdam", params, adam_w_mode, bias_correction)
        super().__init__(
            params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, **flags,
        )  # fmt: skip
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear gradients; ``set_to_none`` defaults to the constructor's ``set_grad_none``."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """Adam/AdamW for CPU-resident (offloaded) parameters, DeepSpeed ``DeepSpeedCPUAdam``'s signature.

    Parameters that are fp32, contiguous and on the CPU (ShardSpeed's offloaded master
    shards) are stepped by ShardSpeed's native vectorised kernel (``ops/cpu_adam``, built on
    first use); everything else (other dtypes or devices, ``amsgrad``, ``maximize``) by
    torch's fused Adam. ``SHARDSPEED_CPU_ADAM=native|torch`` forces the choice; without it a
    failed build falls back to torch's kernel with one log line saying why. The kernel
    computes torch AdamW's update operation by operation (agreement to ~1 fp32 ulp).

    The state layout is ``torch.optim.Adam``'s (``step``, ``exp_avg``, ``exp_avg_sq``), so
    checkpoints and ``safe_get_full_optimizer_state`` are unchanged. ``bias_correction`` is
    kept per param group and needs the native kernel when ``False``. Optimizer states take
    the parameters' dtype: ShardSpeed offloads fp32 master weights, so states are fp32 as
    ``fp32_optimizer_states=True`` asks; with low-precision parameters a note is logged.
    """

    elementwise = True  # step() is overridden; each element reads only its own grad/state
    _backend: Backend | None = None

    def __init__(
        self,
        model_params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        params = materialize(model_params)
        flags = _adam_kwargs("DeepSpeedCPUAdam", params, adamw_mode, bias_correction=True)
        super().__init__(
            params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, **flags,
        )  # fmt: skip
        self.defaults["bias_correction"] = bool(bias_correction)
        for group in self.param_groups:
            group.setdefault("bias_correction", bool(bias_correction))
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        if not bias_correction:  # only the native kernel can skip it
            if amsgrad:
                raise ValueError(
                    "DeepSpeedCPUAdam: bias_correction=False with amsgrad=True is not supported "
                    "(amsgrad runs on torch's Adam, which always bias-corrects). Fix: drop one "
                    "of the two."
                )
            if self.backend == "torch":
                raise ValueError(
                    "DeepSpeedCPUAdam: bias_correction=False needs the native CPU Adam kernel "
                    "(torch's Adam always bias-corrects), but the backend is 'torch' "
                    f"({ENV_VAR}={os.environ.get(ENV_VAR, '<unset>')}; unset or 'auto' means the "
                    "build failed, see the log). Fix: drop bias_correction=False, or make the "
                    f"native kernel available (a C++ compiler and ninja; {ENV_VAR} unset or "
                    "'native')."
                )
        if fp32_optimizer_states and any(
            t.dtype in (torch.float16, torch.bfloat16) for t in param_tensors(params)
        ):
            info_once(
                "DeepSpeedCPUAdam: optimizer states follow the parameter dtype; pass fp32 "
                "master parameters to keep fp32 states (ShardSpeed's offload does this)."
            )

    @property
    def backend(self) -> Backend:
        """``"native"`` or ``"torch"``: the kernel for fp32 CPU parameters (chosen on first use)."""
        if self._backend is None:
            self._backend = select_backend()
        return self._backend

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam/AdamW step: the native kernel where eligible, torch's fused Adam elsewhere."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        splits = [(group, *self._split(group)) for group in self.param_groups]
        for group, _, others in splits:  # check everything before changing anything
            if others and not group.get("bias_correction", True):
                raise ValueError(
                    "DeepSpeedCPUAdam: bias_correction=False needs every parameter with a "
                    "gradient to be a contiguous fp32 CPU tensor (native kernel), got "
                    f"{sorted({f'{p.dtype} on {p.device}' for p in others})}. Fix: pass fp32 "
                    "CPU parameters or drop bias_correction=False."
                )
        stepped: list[Tensor] = []  # parameters the native kernel updated
        for group, native, _ in splits:
            if native.params:
                self._native_step(group, native)
                stepped += native.params
        if any(others for _, _, others in splits):
            self._torch_step(stepped)
        return loss

    def _split(self, group: dict[str, Any]) -> tuple[_NativeBatch, list[Tensor]]:
        """Parameters of ``group`` with a gradient: the native kernel's (with their state,
        created here on first use) and the rest (for torch's kernel)."""
        native = _NativeBatch()
        others: list[Tensor] = []
        group_ok = not (
            group.get("amsgrad")
            or group.get("maximize")
            or group.get("differentiable")
            or group.get("capturable")
        )  # these run on torch's kernel
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if group_ok and _fits(p, p) and _fits(grad, p) and self.backend == "native":
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)  # torch's fused layout
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state.get("exp_avg"), state.get("exp_avg_sq")
                # states loaded in another dtype or layout go to torch's kernel
                if exp_avg is not None and exp_avg_sq is not None:
                    if _fits(exp_avg, p) and _fits(exp_avg_sq, p):
                        if not torch.is_tensor(state["step"]):  # very old checkpoints
                            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                        native.add(p, grad, exp_avg, exp_avg_sq, state["step"])
                        continue
            others.append(p)
        return native, others

    def _native_step(self, group: dict[str, Any], batch: _NativeBatch) -> None:
        beta1, beta2 = group["betas"]
        adam_step_(
            batch.params,
            batch.grads,
            batch.exp_avgs,
            batch.exp_avg_sqs,
            batch.steps,
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw_mode=bool(group.get("decoupled_weight_decay", self.adamw_mode)),
            bias_correction=bool(group.get("bias_correction", True)),
        )

    def _torch_step(self, stepped: list[Tensor]) -> None:
        """torch's Adam over the parameters the native kernel did not step."""
        hidden = [(p, p.grad) for p in stepped]
        for p in stepped:
            p.grad = None  # torch's Adam skips parameters without a gradient
        try:
            super().step()
        finally:
            for p, grad in hidden:
                p.grad = grad


@dataclass
class _NativeBatch:
    """The tensors of one param group that the native kernel steps (parallel lists)."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    steps: list[Tensor] = field(default_factory=list)

    def add(
        self, p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor
    ) -> None:
        self.params.append(p)
        self.grads.append(grad)
        self.exp_avgs.append(exp_avg)
        self.exp_avg_sqs.append(exp_avg_sq)
        self.steps.append(step)


def _fits(t: Tensor, param: Tensor) -> bool:
    """``t`` (the parameter, its grad or a state) is what the native kernel takes with ``param``."""
    return (
        t.dtype is torch.float32
        and t.is_cpu
        and t.layout is torch.strided
        and t.is_contiguous()
        and t.numel() == param.numel()
    )
