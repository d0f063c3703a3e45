"""ZeRO-3 parameter shard state: one flat, padded, sharded buffer per (unit, param group).

A *unit* is a module whose parameters are gathered and released together (each element
of an ``nn.ModuleList``, plus a root unit for everything else). Within a unit, the
parameters of one optimizer param group form a :class:`ShardedFlat`: a single padded
bucket laid out by :func:`shardspeed.zero.partition.build_layout` (world = dp size), of
which this rank keeps only slice ``rank`` persistently (``shard``, param dtype).

Where the shard lives between uses (device, host memory or an NVMe swap file) is its
``storage`` (:mod:`shardspeed.zero.offload.shard_storage`), chosen by the engine's offload
runtime; the gather always all-gathers from a device tensor.

Outside use, ``param.data`` is an empty tensor; the attributes DeepSpeed users rely on
are kept on every managed parameter: ``ds_shape``, ``ds_numel``, ``ds_status``,
``ds_id`` and ``ds_tensor`` (this rank's piece of the parameter, possibly empty).
"""

from __future__ import annotations

import enum

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.zero.init_partition import full_shape, take_full_data
from shardspeed.zero.offload import OffloadRuntime
from shardspeed.zero.offload.host import copy_to_host
from shardspeed.zero.offload.shard_storage import DeviceShard, ShardStorage
from shardspeed.zero.partition import build_layout, param_shard_fragments


class ZeroParamStatus(enum.Enum):
    """Whether a ZeRO-3 parameter's full data is present on this rank."""

    NOT_AVAILABLE = 1  # only the shard exists; ``param.data`` is empty
    INFLIGHT = 2  # an all-gather is running
    AVAILABLE = 3  # ``param.data`` is the full tensor


class ShardedFlat:
    """The parameters of one unit and one optimizer param group, sharded over the dp group."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        unit_id: int,
        first_param_id: int,
        dp_group: object | None,
        world: int,
        rank: int,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        master_dtype: torch.dtype,
        device: torch.device,
        persistent: bool,
        offload: OffloadRuntime | None = None,
    ) -> None:
        self.params = params
        self.unit_id = unit_id
        self.dp_group = dp_group
        self.world = world
        self.rank = rank
        self.device = device
        self.persistent = persistent
        self.offload = offload
        self.label = "<persistent>" if persistent else f"unit {unit_id}"  # reducer tags
        self.group_index = 0  # the optimizer param group (set by the sharding policy)
        shapes = [full_shape(p) for p in params]  # ds_shape of zero.Init-partitioned params
        numels = [shape.numel() for shape in shapes]
        self.layout = build_layout(numels, max(sum(numels), 1), world)
        self.bucket = self.layout.buckets[0]
        self.numel = self.bucket.numel  # padded full size: (world * shard_numel,)
        # full: (numel,) in param dtype, params packed at their slots (rest zero padding).
        full = torch.zeros(self.numel, dtype=param_dtype, device=device)
        for slot, p in zip(self.layout.slots, params):
            # zero.Init-partitioned params: all-gathered from their pieces, which are then freed
            full[slot.offset : slot.offset + slot.numel].copy_(take_full_data(p).reshape(-1))
        lo, hi = self.bucket.shard_range(rank)
        self.shard = full[lo:hi].clone()  # (numel / world,)
        self.grad_shard = torch.zeros_like(self.shard, dtype=grad_dtype)
        self._place_shard_and_master(master_dtype)
        self.full: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, object | None] | None = None
        for i, (p, shape) in enumerate(zip(params, shapes)):
            p.ds_shape = shape
            p.ds_numel = shape.numel()
            p.ds_id = first_param_id + i
            p.ds_persist = persistent
            p._ss_flat = self  # noqa: SLF001 - lookup for GatheredParameters
        self._set_ds_tensors()
        if persistent:
            self._attach(full)
        else:
            self.release()

    @torch.no_grad()
    def _place_shard_and_master(self, master_dtype: torch.dtype) -> None:
        """Move the packed device shard to its storage (device, host or NVMe: the offload
        runtime decides) and create the master and the host gradient buffer.

        ``self.shard`` is then the resident shard (device tensor or separate host tensor),
        or None when it lives in an NVMe swap file.
        """
        shard = self.shard  # (shard_numel,) param dtype, on the device
        assert shard is not None
        self.shard_numel = shard.numel()
        self.param_dtype = shard.dtype
        self.host_grad: torch.Tensor | None = None
        self.host_grad_staged = False  # host_grad already holds the window's final gradient
        runtime = self.offload
        if runtime is not None and runtime.offload_optimizer:
            self.master = runtime.new_master(shard, master_dtype)
            self.host_grad = runtime.new_host_grad(shard.numel(), master_dtype)
        elif shard.dtype == master_dtype and (runtime is None or not runtime.offload_param):
            self.master = shard  # alias: the optimizer updates the shard in place
        else:
            self.master = shard.to(master_dtype).clone()  # on the device
        self.storage: ShardStorage = (
            runtime.shard_storage(shard) if runtime is not None else DeviceShard(shard)
        )
        self.shard = self.storage.resident
        self._gather_src: torch.Tensor | None = None

    # -- status -------------------------------------------------------------------------
    @property
    def status(self) -> ZeroParamStatus:
        if self.full is not None:
            return ZeroParamStatus.AVAILABLE
        if self._pending is not None:
            return ZeroParamStatus.INFLIGHT
        return ZeroParamStatus.NOT_AVAILABLE

    def _set_ds_tensors(self) -> None:
        owned = {idx: (start, length, off) for idx, start, length, off in
                 param_shard_fragments(self.layout, self.rank)}  # fmt: skip
        if self.shard is None:  # NVMe parameter offload: the shard is in a swap file
            owned = {}
        shard = self.shard if self.shard is not None else torch.empty(0, dtype=self.param_dtype)
        for i, p in enumerate(self.params):
            if i in owned:
                _, length, off = owned[i]
                p.ds_tensor = shard[off : off + length]
            else:
                p.ds_tensor = shard[:0]

    def _set_status(self, status: ZeroParamStatus) -> None:
        for p in self.params:
            p.ds_status = status

    # -- gather / release ---------------------------------------------------------------
    def start_gather(self) -> None:
        """Launch the all-gather of the full buffer (asynchronous where the backend allows)."""
        if self.full is not None or self._pending is not None:
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
        if self._pending is None:
            return
        out, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        self._gather_src = None
        self._attach(out)

    def gather(self) -> None:
        self.start_gather()
        self.wait_gather()

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

    @torch.no_grad()
    def scatter_full_to_shard(self) -> None:
        """After an in-place edit of the gathered params: copy this rank's slice into shard/master."""
        assert self.full is not None
        lo, hi = self.bucket.shard_range(self.rank)
        values = self.full[lo:hi]
        self.storage.store(values)
        if self.master is self.shard:
            return
        if self.offload is not None:
            self.offload.overwrite_master(self.master, values)  # host or NVMe master
        else:
            self.master.copy_(values)

    # -- gradients (the reducer's slot interface: shardspeed.zero.reducer.GradSlot) -------
    @property
    def streams_to_host(self) -> bool:
        return self.host_grad is not None

    def describe(self) -> str:
        return self.label

    def owned_range(self) -> tuple[int, int]:
        return self.bucket.shard_range(self.rank)

    def on_grad(self, param: nn.Parameter) -> None:
        """Gradients stay in ``param.grad`` until the flat is packed for its reduction."""

    def reduce_input(self, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(self.numel, dtype=dtype, device=self.device)  # (numel,)
        self.pack_grads(buf)
        return buf

    def store(self, reduced: torch.Tensor) -> None:
        self.grad_shard.add_(reduced)  # accumulate across the window's micro-steps

    @torch.no_grad()
    def pack_grads(self, out: torch.Tensor) -> None:
        """Copy ``param.grad`` of every parameter into ``out`` (zeros where absent); free them."""
        out.zero_()
        for slot, p in zip(self.layout.slots, self.params):
            if p.grad is not None:
                out[slot.offset : slot.offset + slot.numel].copy_(p.grad.reshape(-1))
                p.grad = None

    def stage_host_grad(self) -> None:
        """Start the device -> host copy of the final (reduced) gradient shard; the
        reducer calls it when the shard's last reduction of the window completed, so the
        copy overlaps the rest of backward. A no-op without optimizer offload."""
        if self.host_grad is not None:
            copy_to_host(self.host_grad, self.grad_shard)
            self.host_grad_staged = True

    def optimizer_grad(self) -> torch.Tensor:
        """The gradient shard the optimizer reads: the host copy when offloading (started
        now unless the reducer streamed it already). The optimizer synchronises the device
        before reading it."""
        if self.host_grad is None:
            return self.grad_shard
        if not self.host_grad_staged:
            self.stage_host_grad()
        return self.host_grad

    def zero_grad_shard(self) -> None:
        """Zero the accumulated gradient shard for the next accumulation window."""
        self.grad_shard.zero_()
        self.host_grad_staged = False

    @torch.no_grad()
    def copy_master_to_shard(self) -> None:
        """Write the (updated) master into the shard, wherever the shard lives."""
        if self.master is not self.shard:
            self.storage.store(self.master)

    def storage_bytes(self) -> dict[str, int]:
        """Bytes held in memory by category; ``host`` is the part in host memory because of
        offload (an NVMe-swapped shard or master holds none)."""

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        shard = self.storage.storage_bytes()
        master = 0 if self.master is self.shard else nbytes(self.master)
        host_master = master if self.host_grad is not None else 0
        return {
            "params": shard.get("params", 0) + nbytes(self.full),
            "grads": nbytes(self.grad_shard) + nbytes(self.host_grad),
            "master_params": master,
            "host": shard.get("host", 0) + nbytes(self.host_grad) + host_master,
        }


def owning_flat(param: nn.Parameter) -> ShardedFlat | None:
    """The :class:`ShardedFlat` that manages ``param``, or None for an ordinary parameter."""
    return getattr(param, "_ss_flat", None)
