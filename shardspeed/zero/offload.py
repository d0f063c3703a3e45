"""Optimizer offload to host memory (``zero_optimization.offload_optimizer.device == "cpu"``).

With offload, the fp32 master shards and therefore the optimizer state live in host
memory (page-locked when an accelerator is present, so copies can be asynchronous);
the reduced gradient shard is copied device -> host before the step, the torch optimizer
(fused CPU AdamW from the optimizer factory) updates the host masters, and the result is
copied back into the device parameter shard. Only the ZeRO-3 engine implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def host_zeros(numel: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """A zeroed host tensor of ``(numel,)``, pinned when asked and an accelerator exists."""
    pin = pin_memory and torch.cuda.is_available()
    return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)


@dataclass(frozen=True)
class OffloadPolicy:
    """What the ``offload_optimizer`` / ``offload_param`` blocks ask for, validated."""

    optimizer: bool = False
    pin_memory: bool = True

    @classmethod
    def from_zero_config(cls, zero: Any) -> OffloadPolicy:
        opt = zero.offload_optimizer
        param = zero.offload_param
        if param is not None and param.device != "none":
            raise ValueError(
                f"zero_optimization.offload_param.device={param.device!r} is not supported by "
                "ShardSpeed's ZeRO-3 engine (parameter shards stay on the accelerator); "
                'remove offload_param or set its device to "none".'
            )
        if opt is None or opt.device == "none":
            return cls()
        if opt.device != "cpu":
            raise ValueError(
                f"zero_optimization.offload_optimizer.device={opt.device!r} is not supported; "
                'allowed: "none" or "cpu". Use "cpu" (NVMe offload is not implemented).'
            )
        return cls(optimizer=True, pin_memory=bool(opt.pin_memory))
