"""DeepSpeed-compatible ``FusedLamb`` on ShardSpeed's foreach LAMB."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from shardspeed.optim.lamb import Lamb


class FusedLamb(Lamb):
    """LAMB with DeepSpeed ``FusedLamb``'s signature (see :class:`shardspeed.optim.lamb.Lamb`).

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
