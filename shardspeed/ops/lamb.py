"""LAMB (You et al., 2019) and DeepSpeed's ``FusedLamb`` on it.

LAMB: Adam moments with a per-parameter trust ratio.

For each parameter tensor ``p`` (step ``t``)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)      # if bias_correction
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p          # eps_inside_sqrt: sqrt(v_hat + eps)
    ratio = clamp(||p|| / ||u||, min_coeff, max_coeff)          # 1 if either norm is 0
    p = p - lr * ratio * u

The trust ratio uses the norm of the whole tensor, so LAMB is *not* elementwise: on the
ZeRO engine's flat masters (buckets of concatenated parameters, sharded over ranks at
stages 1-3) it needs to know where each parameter sits. The engine tells it with
:meth:`Lamb.set_param_segments`; the norms of each parameter are then summed over its
fragments, and over the ranks that hold the other fragments, before the ratio is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from shardspeed.ops._validate import check_betas, check_non_negative

# (offset in the flat master, numel, index of the parameter within its param group)
Fragment = tuple[int, int, int]


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
        self._fragments: dict[int, list[list[Fragment]]] = {}  # group index -> per master
        self._norm_groups: dict[int, Any] = {}  # group index -> ranks holding other fragments
        self._param_counts: dict[int, int] = {}
        self._segment_ids: dict[tuple[int, int], Tensor] = {}

    def set_param_segments(
        self,
        segments: Sequence[Sequence[Sequence[Fragment]]],
        groups: Sequence[Any] | None = None,
        param_counts: Sequence[int] | None = None,
    ) -> None:
        """Flat masters: ``segments[g][i]`` lists ``(offset, numel, param_index)`` of every
        parameter fragment inside master ``i`` of param group ``g`` (the same parameter
        numbering on every rank). ``groups[g]``: the process group whose ranks hold the
        other fragments of those parameters (ZeRO >= 1), or None when each rank holds whole
        parameters; per-parameter squared norms are summed over it. ``param_counts[g]``:
        the number of parameters of group ``g`` (every rank's norm vector has this length;
        default: one past the largest index given here)."""
        self._fragments = {
            g: [[(int(o), int(n), int(i)) for o, n, i in frags if n > 0] for frags in masters]
            for g, masters in enumerate(segments)
        }
        self._norm_groups = dict(enumerate(groups)) if groups is not None else {}
        self._param_counts = {
            g: int(param_counts[g]) if param_counts is not None
            else 1 + max((f[2] for per in masters for f in per), default=-1)
            for g, masters in self._fragments.items()
        }  # fmt: skip
        self._segment_ids = {}

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
        for gi, group in enumerate(self.param_groups):
            if gi in self._fragments:
                coeffs.append(self._update_flat(gi, group))
                continue
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
        updates = self._adam_updates(group, params)
        # (num_params,) fp32 norms -> clamped trust ratios
        param_norms = torch.stack(torch._foreach_norm(params)).float()
        update_norms = torch.stack(torch._foreach_norm(updates)).float()
        ratios = _trust_ratios(group, param_norms, update_norms)
        scales = (ratios * -float(group["lr"])).to(params[0].dtype)
        torch._foreach_mul_(updates, list(scales.unbind()))
        torch._foreach_add_(params, updates)
        return ratios

    def _update_flat(self, gi: int, group: dict[str, Any]) -> Tensor:
        """Flat masters of param group ``gi``: one trust ratio per parameter, its norms
        summed over its fragments (and over the ranks of ``_norm_groups[gi]``)."""
        masters = group["params"]
        live = [i for i, m in enumerate(masters) if m.grad is not None]
        num_params = self._param_counts[gi]
        norm_group = self._norm_groups.get(gi)
        if num_params == 0 or (not live and norm_group is None):
            return torch.ones(0)
        params = [masters[i] for i in live]
        updates = self._adam_updates(group, params) if params else []
        # squared norms per parameter: (2, num_params + 1); the last slot takes the padding
        sums = torch.zeros(2, num_params + 1, dtype=torch.float32, device=masters[0].device)
        ids = [self._ids(gi, i, masters[i], num_params) for i in live]
        for p, u, seg in zip(params, updates, ids):
            sums[0].index_add_(0, seg, p.detach().float().square())
            sums[1].index_add_(0, seg, u.float().square())
        if norm_group is not None:  # every rank joins, even one without gradients here
            import torch.distributed as dist

            dist.all_reduce(sums, group=norm_group)
        ratios = _trust_ratios(group, sums[0, :-1].sqrt(), sums[1, :-1].sqrt())
        scale = torch.cat([ratios, ratios.new_ones(1)]) * -float(group["lr"])  # (P + 1,)
        for p, u, seg in zip(params, updates, ids):
            p.add_(u.mul_(scale[seg].to(u.dtype)))
        return ratios

    def _ids(self, gi: int, i: int, master: Tensor, num_params: int) -> Tensor:
        """``(numel,)`` parameter index of every element of master ``i`` (padding: P)."""
        key = (gi, i)
        if key not in self._segment_ids:
            ids = torch.full((master.numel(),), num_params, dtype=torch.long)
            for offset, numel, index in self._fragments[gi][i]:
                ids[offset : offset + numel] = index
            self._segment_ids[key] = ids.to(master.device)
        return self._segment_ids[key]

    def _adam_updates(self, group: dict[str, Any], params: list[Tensor]) -> list[Tensor]:
        """Advance the moments of ``params``; return ``u = m_hat / denom + wd * p`` each."""
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
        return updates


def _trust_ratios(group: dict[str, Any], param_norms: Tensor, update_norms: Tensor) -> Tensor:
    """``||p|| / ||u||`` clamped to [min_coeff, max_coeff]; 1 where either norm is 0."""
    ratios = (param_norms / update_norms).clamp(group["min_coeff"], group["max_coeff"])
    return torch.where((param_norms > 0) & (update_norms > 0), ratios, 1.0)


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
