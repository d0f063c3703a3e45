"""LAMB (You et al., 2019) and DeepSpeed's ``FusedLamb`` on it.

LAMB: Adam moments with a per-parameter trust ratio.

For each parameter tensor ``p`` (step ``t``)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)      # if bias_correction
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p          # eps_inside_sqrt: sqrt(v_hat + eps)
    ratio = clamp(||p|| / ||u||, min_coeff, max_coeff)          # 1 if either norm is 0
    p = p - lr * ratio * u

The trust ratio uses the norm of the whole tensor, so LAMB is *not* elementwise: it
cannot run on an arbitrary flat shard of concatenated parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from shardspeed.ops._validate import check_betas, check_non_negative


class Lamb(Optimizer):
    """LAMB with DeepSpeed ``FusedLamb``'s knobs, built on ``torch._foreach_*`` kernels.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta**t``.
        betas: Adam moment decay rates.
        eps: denominator term.
        eps_inside_sqrt: use ``sqrt(v_hat + eps)`` instead of ``sqrt(v_hat) + eps``.
        weight_decay: L2 term added to the update before the trust ratio.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.

    After each :meth:`step`, :meth:`get_lamb_coeffs` returns the trust ratio of every
    updated parameter (as DeepSpeed's ``FusedLamb.get_lamb_coeffs``).
    """

    elementwise = False

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            check_non_negative("Lamb", name, value)
        check_non_negative("Lamb", "min_coeff", min_coeff)
        if max_coeff < min_coeff:
            raise ValueError(
                f"Lamb: max_coeff={max_coeff!r} is smaller than min_coeff={min_coeff!r}; "
                "the trust ratio is clamped to [min_coeff, max_coeff], so max_coeff must be >= min_coeff."
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=check_betas("Lamb", betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._lamb_coeffs: list[Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied by the last :meth:`step`, one per updated parameter."""
        return [float(c) for ratios in self._lamb_coeffs for c in ratios.tolist()]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coeffs: list[Tensor] = []
        for group in self.param_groups:
            by_device: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(
                        "Lamb does not support sparse gradients; use dense embeddings (sparse=False)."
                    )
                by_device.setdefault((p.device, p.dtype), []).append(p)
            for params in by_device.values():
                coeffs.append(self._update(group, params))
        self._lamb_coeffs = coeffs  # kept on device: no host sync unless asked for
        return loss

    def _update(self, group: dict[str, Any], params: list[Tensor]) -> Tensor:
        """Update ``params`` (same device and dtype) in place; return their trust ratios."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            steps.append(float(state["step"]))
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])

        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["bias_correction"]:
            updates = torch._foreach_div(exp_avgs, [1.0 - beta1**t for t in steps])
            denoms = torch._foreach_div(exp_avg_sqs, [1.0 - beta2**t for t in steps])
        else:
            updates = torch._foreach_mul(exp_avgs, 1.0)
            denoms = torch._foreach_mul(exp_avg_sqs, 1.0)
        if group["eps_inside_sqrt"]:
            torch._foreach_add_(denoms, group["eps"])
            torch._foreach_sqrt_(denoms)
        else:
            torch._foreach_sqrt_(denoms)
            torch._foreach_add_(denoms, group["eps"])
        torch._foreach_div_(updates, denoms)  # u = m_hat / denom
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        # (num_params,) fp32 norms -> clamped trust ratios
        param_norms = torch.stack(torch._foreach_norm(params)).float()
        update_norms = torch.stack(torch._foreach_norm(updates)).float()
        ratios = (param_norms / update_norms).clamp(group["min_coeff"], group["max_coeff"])
        ratios = torch.where((param_norms > 0) & (update_norms > 0), ratios, 1.0)

        scales = (ratios * -float(group["lr"])).to(params[0].dtype)
        torch._foreach_mul_(updates, list(scales.unbind()))
        torch._foreach_add_(params, updates)
        return ratios


class FusedLamb(Lamb):
    """LAMB with DeepSpeed ``FusedLamb``'s signature (see :class:`Lamb`).

    ``max_grad_norm`` must stay 0: clip with the top-level ``gradient_clipping`` key (or
    ``torch.nn.utils.clip_grad_norm_``). ``amsgrad`` is not supported, as in DeepSpeed.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if max_grad_norm:
            raise ValueError(
                f"FusedLamb: max_grad_norm={max_grad_norm!r} is not supported; clip gradients "
                "with the top-level ds_config key 'gradient_clipping' (or "
                "torch.nn.utils.clip_grad_norm_) and leave max_grad_norm at 0."
            )
        if amsgrad:
            raise ValueError("FusedLamb: amsgrad=True is not supported; remove the argument.")
        super().__init__(
            params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
            eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
            max_coeff=max_coeff, min_coeff=min_coeff,
        )  # fmt: skip
