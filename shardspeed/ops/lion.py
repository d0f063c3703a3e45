"""DeepSpeed-compatible ``FusedLion`` and ``DeepSpeedCPULion`` on ShardSpeed's Lion."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from shardspeed.optim.lion import Lion


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
