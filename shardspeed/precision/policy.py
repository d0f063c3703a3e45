"""The mixed-precision policy: which dtype each tensor family uses.

Chosen once from the config; the engine and the sharded optimizer only read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: Any, what: str) -> torch.dtype | None:
    """``"bf16"``/``torch.bfloat16``/None -> torch dtype, with an error naming ``what``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(
            f"{what}={value!r} is not a supported dtype; use one of 'fp32', 'fp16', 'bf16'."
        )
    return _DTYPE_NAMES[key]


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of model parameters, gradient reduction, accumulation and master weights.

    * ``param_dtype``: what the module's parameters (and compute) are stored in.
    * ``reduce_dtype``: what gradients are communicated in.
    * ``grad_accum_dtype``: what gradients are stored and accumulated in. None (the
      default) means the parameter dtype when there is nothing to accumulate (GAS = 1)
      and fp32 when accumulating over micro-steps; see :meth:`grad_dtype`.
    * ``master_dtype``: what the optimizer updates (always fp32 here).
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32

    def grad_dtype(self, gradient_accumulation_steps: int) -> torch.dtype:
        """Dtype of the engine's gradient buffers for a given accumulation length."""
        if self.grad_accum_dtype is not None:
            return self.grad_accum_dtype
        return self.param_dtype if gradient_accumulation_steps == 1 else torch.float32

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype != self.master_dtype

    @property
    def uses_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16

    @classmethod
    def from_config(cls, config: Any) -> MixedPrecision:
        """Build from a ShardSpeedConfig (fp16/bf16 blocks, data_types, communication_data_type)."""
        if config.fp16.enabled:
            param = torch.float16
        elif config.bf16.enabled:
            param = torch.bfloat16
        else:
            param = torch.float32
        reduce = parse_dtype(config.communication_data_type, "communication_data_type") or param
        accum = parse_dtype(
            getattr(config.data_types, "grad_accum_dtype", None), "data_types.grad_accum_dtype"
        )
        return cls(
            param_dtype=param,
            reduce_dtype=reduce,
            grad_accum_dtype=accum,
            master_dtype=torch.float32,
        )
