"""The offload machinery of one engine, built once from its :class:`OffloadPolicy`.

The flat buffers ask it for their masters, host gradient buffers and (stage 3) parameter
shard storage, so they never switch on the offload device themselves; the sharded
optimizer asks it for the NVMe swapper. ``close()`` (``engine.destroy()``) waits for
outstanding I/O, stops the I/O threads and deletes the swap files.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.utils.logging import warning_once
from shardspeed.zero.offload.file_io import AsyncFileIO
from shardspeed.zero.offload.host import host_copy, host_zeros
from shardspeed.zero.offload.optimizer_swapper import EXPECTED_STATE_TENSORS, OptimizerSwapper
from shardspeed.zero.offload.param_swapper import ParamSwapper
from shardspeed.zero.offload.policy import OffloadPolicy, SwapSettings
from shardspeed.zero.offload.shard_storage import DeviceShard, HostShard, NvmeShard, ShardStorage
from shardspeed.zero.offload.swap_dir import SwapDir


class OffloadRuntime:
    """Host buffers, swap directories, I/O threads and swappers for one engine on one rank.

    ``numel_per_rank`` (trainable elements this rank will hold, about P / N) sizes the
    up-front free-space check of each ``nvme_path``.
    """

    def __init__(
        self,
        policy: OffloadPolicy,
        *,
        rank: int,
        device: torch.device,
        numel_per_rank: int,
        param_dtype: torch.dtype,
        master_dtype: torch.dtype,
    ) -> None:
        self.policy = policy
        self.device = device
        self._closers: list[object] = []
        self.optimizer_swapper: OptimizerSwapper | None = None
        self.param_swapper: ParamSwapper | None = None
        if policy.optimizer_swap is not None:
            needed = numel_per_rank * master_dtype.itemsize * (1 + EXPECTED_STATE_TENSORS)
            swap_dir, io = self._open(policy.optimizer_swap, rank, needed)
            self.optimizer_swapper = OptimizerSwapper(policy.optimizer_swap, swap_dir, io)
        if policy.param_swap is not None:
            needed = numel_per_rank * param_dtype.itemsize
            swap_dir, io = self._open(policy.param_swap, rank, needed)
            self.param_swapper = ParamSwapper(policy.param_swap, swap_dir, io)

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        has_optimizer: bool,
        rank: int,
        device: torch.device,
        numel_per_rank: int,
        param_dtype: torch.dtype,
        master_dtype: torch.dtype,
    ) -> OffloadRuntime:
        """The runtime for a :class:`~shardspeed.config.ShardSpeedConfig` (a no-op one when
        nothing is offloaded). Without an optimizer there is nothing to offload for
        ``offload_optimizer``: it is switched off with a warning."""
        policy = OffloadPolicy.from_zero_config(config.zero_optimization, config.aio)
        if policy.optimizer and not has_optimizer:
            warning_once(
                f"zero_optimization.offload_optimizer.device={policy.optimizer_device!r} has no "
                "effect: the engine has no optimizer (pass optimizer= to initialize() or add an "
                "'optimizer' block to train)."
            )
            policy = policy.without_optimizer()
        return cls(
            policy,
            rank=rank,
            device=device,
            numel_per_rank=numel_per_rank,
            param_dtype=param_dtype,
            master_dtype=master_dtype,
        )

    def _open(self, settings: SwapSettings, rank: int, needed: int) -> tuple[SwapDir, AsyncFileIO]:
        swap_dir = SwapDir(settings.nvme_path, settings.key, rank, needed)
        io = AsyncFileIO(settings.threads, settings.block_size, swap_dir.no_space_error)
        self._closers += [io, swap_dir]
        return swap_dir, io

    # -- what the flat buffers ask for -----------------------------------------------------
    @property
    def offload_optimizer(self) -> bool:
        """Masters, their gradients and the optimizer step live on the host (or NVMe)."""
        return self.policy.optimizer

    @property
    def offload_param(self) -> bool:
        return self.policy.param

    def new_master(self, shard: torch.Tensor, master_dtype: torch.dtype) -> torch.Tensor:
        """A host master initialised from ``shard``; with NVMe it is written out and swapped."""
        if self.optimizer_swapper is not None:
            master = host_copy(shard, master_dtype, pin_memory=False)
            self.optimizer_swapper.register(master)
            return master
        return host_copy(shard, master_dtype, self.policy.pin_memory)

    def new_host_grad(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The host buffer a gradient shard is copied into for the optimizer step."""
        return host_zeros(numel, dtype, self.policy.pin_memory)

    def shard_storage(self, shard: torch.Tensor) -> ShardStorage:
        """Stage 3: where the persistent parameter shard lives (``shard`` is on the device)."""
        if self.param_swapper is not None:
            return NvmeShard(shard, self.device, self.param_swapper)
        if self.policy.param_device == "cpu":
            return HostShard(shard, self.device, self.policy.param_pin_memory)
        return DeviceShard(shard)

    @torch.no_grad()
    def overwrite_master(self, master: torch.Tensor, values: torch.Tensor) -> None:
        """Set a master's values (``GatheredParameters`` edits), wherever it lives."""
        if self.optimizer_swapper is not None:
            self.optimizer_swapper.overwrite_master(master, values)
        else:
            master.copy_(values.reshape(-1))

    # -- accounting and shutdown ------------------------------------------------------------
    def storage_bytes(self) -> dict[str, int]:
        """``swap_buffers`` (host staging buffers) and ``nvme`` (swap-file bytes)."""
        out = {"swap_buffers": 0, "nvme": 0}
        for swapper in (self.optimizer_swapper, self.param_swapper):
            if swapper is not None:
                for key, value in swapper.storage_bytes().items():
                    out[key] += value
        return out

    def close(self) -> None:
        """Finish outstanding I/O, stop the I/O threads, delete the swap files."""
        for swapper in (self.optimizer_swapper, self.param_swapper):
            if swapper is not None:
                swapper.close()
        for item in self._closers:
            item.close()  # type: ignore[attr-defined]
        self._closers = []
