"""Where a flat group's parameters live: its *residency* policy.

A :class:`~shardspeed.zero.flat_buffer.FlatGroup` packs parameters into one padded flat
buffer at every stage; what differs between stages 0-2 and stage 3 is only where the full
buffer lives:

* :class:`WholeResidency` (stages 0-2): the full buffer is always present and every
  parameter is a permanent view into it; gather and release are no-ops.
* :class:`GatheredResidency` (stage 3): this rank keeps only its slice (the *shard*) in a
  :mod:`~shardspeed.zero.offload.shard_storage` (device, host memory or an NVMe file); the
  full buffer is all-gathered around use and dropped after. Outside use ``param.data`` is
  an empty tensor, and the attributes DeepSpeed users rely on are kept on every managed
  parameter: ``ds_shape``, ``ds_numel``, ``ds_status``, ``ds_id``, ``ds_persist`` and
  ``ds_tensor`` (this rank's piece of the parameter, possibly empty).

Both answer the same questions for the flat group: the status of the full buffer, the
tensor the masters start from (:meth:`initial_shard`), where updated values go
(:meth:`write_shard`), and the bytes they hold.

With ZeRO++ (qwZ / hpZ) a gathered residency hands its gathers to a
:class:`~shardspeed.zero.zeropp.weights.WeightGathers` (:meth:`GatheredResidency.use_gathers`):
quantized all-gathers, and backward gathers from a node-local secondary partition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.zero.offload.shard_storage import DeviceShard, ShardStorage
from shardspeed.zero.params import ZeroParamStatus
from shardspeed.zero.partition import FlatLayout, param_shard_fragments

if TYPE_CHECKING:
    from shardspeed.zero.offload import OffloadRuntime
    from shardspeed.zero.zeropp.weights import PendingGather, WeightGathers


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class WholeResidency:
    """Stages 0-2: the full flat buffer is always present (parameters are views into it)."""

    around_use = False  # the full buffer is always present

    def __init__(self, full: torch.Tensor, layout: FlatLayout, rank: int) -> None:
        self.full: torch.Tensor = full  # (layout.numel,) param dtype
        self.layout = layout
        self.rank = rank

    @property
    def status(self) -> ZeroParamStatus:
        return ZeroParamStatus.AVAILABLE

    def initial_shard(self, bucket_index: int) -> torch.Tensor:
        """This rank's slice of bucket ``bucket_index``: a view of the full buffer."""
        lo, hi = self.layout.buckets[bucket_index].shard_range(self.rank)
        return self.full[lo:hi]

    @property
    def master_may_alias(self) -> bool:
        """An fp32 master may be the parameter slice itself (updated in place)."""
        return True

    def write_shard(self, bucket_index: int, values: torch.Tensor) -> None:
        self.initial_shard(bucket_index).copy_(values)

    def start_gather(self) -> None:
        """Nothing to gather: the parameters are always whole."""

    def wait_gather(self) -> None:
        """Nothing to wait for."""

    def release(self) -> None:
        """Parameters stay whole."""

    def storage_bytes(self) -> dict[str, int]:
        return {"params": _nbytes(self.full), "host": 0}


class GatheredResidency:
    """Stage 3: this rank's shard persists; the full buffer is gathered around use.

    Built from the packed full buffer (``full``, this rank's copy of the initial values):
    the shard is cloned out of it, the masters start from that device shard
    (:meth:`initial_shard`), and :meth:`place` then moves the shard to the storage the
    offload runtime chooses (after which the device copy may be gone).
    """

    around_use = True  # the full buffer exists only between gather and release

    def __init__(
        self,
        owner: object,
        params: list[nn.Parameter],
        shapes: list[torch.Size],
        layout: FlatLayout,
        full: torch.Tensor,
        *,
        rank: int,
        world: int,
        dp_group: object | None,
        device: torch.device,
        first_param_id: int,
        persistent: bool,
        offload: OffloadRuntime | None,
    ) -> None:
        assert len(layout.buckets) == 1, "a gathered flat is one bucket (one all-gather)"
        self.params = params
        self.layout = layout
        self.rank = rank
        self.world = world
        self.dp_group = dp_group
        self.device = device
        self.persistent = persistent
        self.offload = offload
        self.numel = layout.numel  # padded full size: (world * shard_numel,)
        self.param_dtype = full.dtype
        lo, hi = layout.buckets[0].shard_range(rank)
        self._initial: torch.Tensor | None = full[lo:hi].clone()  # (numel / world,)
        self.storage: ShardStorage = DeviceShard(self._initial)
        self.full: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, object | None] | None = None
        self._gather_src: torch.Tensor | None = None
        self.gathers: WeightGathers | None = None  # ZeRO++ (qwZ / hpZ): see use_gathers
        self._zeropp_pending: PendingGather | None = None
        for i, (p, shape) in enumerate(zip(params, shapes)):
            p.ds_shape = shape
            p.ds_numel = shape.numel()
            p.ds_id = first_param_id + i
            p.ds_persist = persistent
            p._ss_flat = owner  # noqa: SLF001 - lookup for GatheredParameters
        self._full_at_build = full

    # -- construction -------------------------------------------------------------------
    def initial_shard(self, bucket_index: int) -> torch.Tensor:
        assert bucket_index == 0 and self._initial is not None
        return self._initial

    @property
    def master_may_alias(self) -> bool:
        """The master may be the device shard itself unless parameter offload moves it."""
        return self.offload is None or not self.offload.offload_param

    def place(self) -> None:
        """Move the shard to its storage (device, host or NVMe: the offload runtime
        decides), publish ``ds_tensor`` and leave the parameters released (or gathered,
        for a persistent flat)."""
        assert self._initial is not None
        runtime = self.offload
        if runtime is not None:
            self.storage = runtime.shard_storage(self._initial)
        self._initial = None
        self._set_ds_tensors()
        full, self._full_at_build = self._full_at_build, None
        if self.persistent:
            self._attach(full)
        else:
            self.release()

    @property
    def resident(self) -> torch.Tensor | None:
        """The shard tensor when held in memory (device or host), None when on NVMe."""
        return self.storage.resident

    def _set_ds_tensors(self) -> None:
        owned = {idx: (length, off) for idx, _, length, off in
                 param_shard_fragments(self.layout, self.rank)}  # fmt: skip
        shard = self.resident
        if shard is None:  # NVMe parameter offload: the shard is in a swap file
            owned, shard = {}, torch.empty(0, dtype=self.param_dtype)
        for i, p in enumerate(self.params):
            length, off = owned.get(i, (0, 0))
            p.ds_tensor = shard[off : off + length]

    def _set_status(self, status: ZeroParamStatus) -> None:
        for p in self.params:
            p.ds_status = status

    @property
    def status(self) -> ZeroParamStatus:
        if self.full is not None:
            return ZeroParamStatus.AVAILABLE
        if self._pending is not None or self._zeropp_pending is not None:
            return ZeroParamStatus.INFLIGHT
        return ZeroParamStatus.NOT_AVAILABLE

    # -- gather / release ---------------------------------------------------------------
    def use_gathers(self, gathers: WeightGathers) -> None:
        """ZeRO++: gather through ``gathers`` (quantized, or from the hpZ secondary copy)."""
        self.gathers = gathers

    def shard_changed(self) -> None:
        """The shard was updated in place (an aliased master's step): a ZeRO++ secondary
        copy of the old values is stale."""
        if self.gathers is not None:
            self.gathers.drop_secondary()

    def start_gather(self) -> None:
        """Launch the all-gather of the full buffer (asynchronous where the backend allows)."""
        if self.full is not None or self._pending is not None or self._zeropp_pending is not None:
            return
        if self.gathers is not None and self.world > 1:
            self._zeropp_pending = self.gathers.start(self.storage.gather_source, self.numel)
            self._set_status(ZeroParamStatus.INFLIGHT)
            return
        # (shard_numel,) on the device: the shard itself, or a copy from host / NVMe
        src = self.storage.gather_source()
        out = torch.empty(self.numel, dtype=self.param_dtype, device=self.device)
        if self.world == 1:
            out.copy_(src)
            work = None
        else:
            work = comm.all_gather_into_tensor(out, src, group=self.dp_group, async_op=True)
        self._gather_src = src  # alive until the gather finishes
        self._pending = (out, work)
        self._set_status(ZeroParamStatus.INFLIGHT)

    def wait_gather(self) -> None:
        """Finish a launched gather and point every parameter at its view of the full buffer."""
        if self._zeropp_pending is not None:
            assert self.gathers is not None
            pending, self._zeropp_pending = self._zeropp_pending, None
            self._attach(self.gathers.finish(pending))
            return
        if self._pending is None:
            return
        out, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        self._gather_src = None
        self._attach(out)

    def _attach(self, full: torch.Tensor) -> None:
        self.full = full
        for slot, p in zip(self.layout.slots, self.params):
            p.data = full[slot.offset : slot.offset + slot.numel].view(p.ds_shape)
        self._set_status(ZeroParamStatus.AVAILABLE)

    def release(self) -> None:
        """Drop the full buffer; parameters become empty tensors again."""
        self.wait_gather()
        for p in self.params:
            p.data = torch.empty(0, dtype=self.param_dtype, device=self.device)
        self.full = None
        self._set_status(ZeroParamStatus.NOT_AVAILABLE)

    def gathered_shard(self) -> torch.Tensor:
        """This rank's slice of the gathered full buffer (after an in-place edit of it)."""
        assert self.full is not None
        lo, hi = self.layout.buckets[0].shard_range(self.rank)
        return self.full[lo:hi]

    def write_shard(self, bucket_index: int, values: torch.Tensor) -> None:
        self.storage.store(values)
        self.shard_changed()

    def storage_bytes(self) -> dict[str, int]:
        shard = self.storage.storage_bytes()
        extra = 0 if self.gathers is None else self.gathers.secondary_bytes()
        params = shard.get("params", 0) + _nbytes(self.full) + extra
        return {"params": params, "host": shard.get("host", 0)}
