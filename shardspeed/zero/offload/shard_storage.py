"""Where a stage-3 parameter shard lives between uses: device, host memory, or an NVMe file.

A stage-3 :class:`~shardspeed.zero.flat_buffer.FlatGroup` (its
:class:`~shardspeed.zero.residency.GatheredResidency`) keeps its persistent shard (this rank's
1/N of the unit's flat buffer, in the parameter dtype) in one of these. The gather asks
for ``gather_source()``: a tensor on the device to all-gather from; the optimizer (and
``GatheredParameters`` edits) write new values with ``store()``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shardspeed.zero.offload.host import host_copy
from shardspeed.zero.offload.param_swapper import ParamSwapper


class ShardStorage(Protocol):
    numel: int
    dtype: torch.dtype

    @property
    def resident(self) -> torch.Tensor | None:
        """The shard tensor when it is held in memory (device or host), else None."""

    def gather_source(self) -> torch.Tensor:
        """This rank's shard on the device, to all-gather from (may be a fresh copy)."""

    def store(self, src: torch.Tensor) -> None:
        """Overwrite the shard with ``src`` (any device, cast to the shard dtype)."""

    def storage_bytes(self) -> dict[str, int]:
        """``params`` (bytes in memory), ``host`` (of which in host memory), ``nvme``."""


class DeviceShard:
    """No parameter offload: the shard stays on the accelerator."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.shard = shard
        self.numel = shard.numel()
        self.dtype = shard.dtype

    @property
    def resident(self) -> torch.Tensor:
        return self.shard

    def gather_source(self) -> torch.Tensor:
        return self.shard

    def store(self, src: torch.Tensor) -> None:
        self.shard.copy_(src.reshape(-1))

    def storage_bytes(self) -> dict[str, int]:
        return {"params": self.shard.numel() * self.shard.element_size()}


class HostShard:
    """``offload_param.device: cpu``: the shard in (pinned) host memory, a separate tensor
    from anything on the device; each gather copies it to the device first."""

    def __init__(self, shard: torch.Tensor, device: torch.device, pin_memory: bool) -> None:
        self.shard = host_copy(shard, shard.dtype, pin_memory)
        self.device = device
        self.numel = shard.numel()
        self.dtype = shard.dtype

    @property
    def resident(self) -> torch.Tensor:
        return self.shard

    def gather_source(self) -> torch.Tensor:
        # A new device tensor even when the device is the CPU; asynchronous from pinned
        # memory (the host shard only changes in the optimizer step, after a device sync).
        out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        out.copy_(self.shard, non_blocking=self.shard.is_pinned())
        return out

    def store(self, src: torch.Tensor) -> None:
        self.shard.copy_(src.reshape(-1))

    def storage_bytes(self) -> dict[str, int]:
        nbytes = self.shard.numel() * self.shard.element_size()
        return {"params": nbytes, "host": nbytes}


class NvmeShard:
    """``offload_param.device: nvme``: the shard in a swap file, read (with read-ahead)
    before each gather."""

    def __init__(self, shard: torch.Tensor, device: torch.device, swapper: ParamSwapper) -> None:
        self.swapper = swapper
        self.device = device
        self.numel = shard.numel()
        self.dtype = shard.dtype
        self.index = swapper.register(shard)

    @property
    def resident(self) -> None:
        return None

    def gather_source(self) -> torch.Tensor:
        return self.swapper.load(self.index, self.device)

    def store(self, src: torch.Tensor) -> None:
        self.swapper.store(self.index, src)

    def storage_bytes(self) -> dict[str, int]:
        return {}  # the file bytes are reported once, by the ParamSwapper
