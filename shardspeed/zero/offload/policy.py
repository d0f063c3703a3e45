"""What the ``offload_optimizer`` / ``offload_param`` / ``aio`` blocks ask for, resolved once.

:class:`OffloadPolicy` is a small frozen object the engines read; the machinery that
carries it out (host buffers, swap files, I/O threads) is
:class:`~shardspeed.zero.offload.runtime.OffloadRuntime`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Device = Literal["none", "cpu", "nvme"]

OPTIMIZER_KEY = "zero_optimization.offload_optimizer"
PARAM_KEY = "zero_optimization.offload_param"


@dataclass(frozen=True)
class SwapSettings:
    """Where and how one kind of state is swapped to NVMe files.

    ``key`` is the ds_config block (named in every error); ``buffer_size`` is in elements
    (``None`` for the optimizer, whose buffers are sized to the largest master shard).
    """

    key: str
    nvme_path: str
    buffer_count: int
    buffer_size: int | None
    pin_memory: bool
    block_size: int  # bytes per I/O request (aio.block_size)
    threads: int  # I/O threads per read/write (aio.intra_op_parallelism)


@dataclass(frozen=True)
class OffloadPolicy:
    """Where fp32 masters + optimizer state (``optimizer_device``) and, at stage 3, the
    parameter shards (``param_device``) live: ``"none"`` (the accelerator), ``"cpu"``
    (host memory, pinned when ``pin_memory`` and CUDA is present) or ``"nvme"`` (swap
    files under ``nvme_path``, staged through a bounded pool of host buffers)."""

    optimizer_device: Device = "none"
    param_device: Device = "none"
    pin_memory: bool = True
    param_pin_memory: bool = True
    optimizer_swap: SwapSettings | None = None
    param_swap: SwapSettings | None = None

    @property
    def optimizer(self) -> bool:
        """True when the masters and the optimizer step are off the accelerator."""
        return self.optimizer_device != "none"

    @property
    def param(self) -> bool:
        """True when ZeRO-3 parameter shards are off the accelerator."""
        return self.param_device != "none"

    def without_optimizer(self) -> OffloadPolicy:
        """The same policy with optimizer offload switched off (an engine with no optimizer)."""
        return OffloadPolicy(
            param_device=self.param_device,
            param_pin_memory=self.param_pin_memory,
            param_swap=self.param_swap,
        )

    def describe(self) -> str:
        return f"optimizer offload {self.optimizer_device}, param offload {self.param_device}"

    @classmethod
    def from_zero_config(cls, zero: Any, aio: Any = None) -> OffloadPolicy:
        """Resolve ``zero_optimization`` (+ the top-level ``aio`` block) into a policy.

        Stage rules (``offload_param`` needs stage 3, offload needs stage >= 1, NVMe
        optimizer offload needs stage 3) are checked by the config model itself.
        """
        block_size = int(getattr(aio, "block_size", 1 << 20))
        threads = int(getattr(aio, "intra_op_parallelism", 1))
        opt, param = zero.offload_optimizer, zero.offload_param
        opt_device: Device = opt.device if opt is not None else "none"
        param_device: Device = param.device if param is not None else "none"
        opt_swap = param_swap = None
        if opt is not None and opt_device == "nvme":
            opt_swap = SwapSettings(
                key=OPTIMIZER_KEY,
                nvme_path=str(opt.nvme_path),
                buffer_count=int(opt.buffer_count),
                buffer_size=None,
                pin_memory=bool(opt.pin_memory),
                block_size=block_size,
                threads=threads,
            )
        if param is not None and param_device == "nvme":
            param_swap = SwapSettings(
                key=PARAM_KEY,
                nvme_path=str(param.nvme_path),
                buffer_count=int(param.buffer_count),
                buffer_size=int(param.buffer_size),
                pin_memory=bool(param.pin_memory),
                block_size=block_size,
                threads=threads,
            )
        return cls(
            optimizer_device=opt_device,
            param_device=param_device,
            pin_memory=bool(opt.pin_memory) if opt is not None else True,
            param_pin_memory=bool(param.pin_memory) if param is not None else True,
            optimizer_swap=opt_swap,
            param_swap=param_swap,
        )
