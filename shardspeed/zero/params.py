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


# -- units and the fetch/release coordinator ------------------------------------------------
class ZeroOrderError(RuntimeError):
    """Ranks issued ZeRO-3 collectives for different units (their module order diverged)."""


class Unit:
    """A module whose sharded parameters are gathered and released together."""

    def __init__(self, unit_id: int, name: str, module: nn.Module, is_root: bool) -> None:
        self.id = unit_id
        self.name = name or "<root>"
        self.module = module
        self.is_root = is_root
        self.flats: list[ShardedFlat] = []

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.flats)

    def available(self) -> bool:
        return all(f.status is ZeroParamStatus.AVAILABLE for f in self.flats)


class OrderCheck:
    """Cross-rank check that every rank is about to run the same ZeRO-3 collective.

    One tiny all-reduce (max of ``[code, -code]``) before each gather/reduction: if all
    ranks agree the collectives that follow match; otherwise every rank raises
    :class:`ZeroOrderError` at the same point instead of hanging in mismatched collectives.
    """

    def __init__(self, dp_group: object | None, world: int, device: torch.device, enabled: bool):
        self.dp_group = dp_group
        self.enabled = enabled and world > 1
        self.device = device

    def __call__(self, code: int, what: str) -> None:
        if not self.enabled:
            return
        t = torch.tensor([code, -code], dtype=torch.int64, device=self.device)
        comm.all_reduce(t, op=comm.ReduceOp.MAX, group=self.dp_group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != code or lo != code:
            raise ZeroOrderError(
                f"ZeRO-3: ranks diverged: this rank is about to {what} (code {code}) while other "
                f"ranks are at codes {lo}..{hi}. Every rank must run the same modules in the same "
                "order (a data-dependent branch that skips a module on some ranks only is not "
                "supported); run the module on every rank (e.g. multiply its output by 0) or "
                "keep its parameters unsharded by raising "
                "zero_optimization.stage3_param_persistence_threshold."
            )


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FetchCoordinator:
    """Forward/backward hooks that gather units before use and release them after.

    * root unit: gathered by the model's forward pre-hook, kept through backward
      (tied weights such as ``wte``/``lm_head`` live there), released after the reduction;
    * other units: gathered by their forward pre-hook (prefetching the next unit of the
      previous forward's order), released by their forward post-hook; gathered again when
      the gradient of their output arrives, released once their gradients are complete.
    """

    def __init__(
        self,
        units: list[Unit],
        check: OrderCheck,
        prefetch_numel: int,
        max_live_numel: int = 0,
        max_reuse_distance: int = 0,
    ) -> None:
        self.units = units
        self.root = units[0]
        self.check = check
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.kept: set[int] = set()  # units kept gathered from their forward to their backward
        self.prev_order: list[int] = []
        self.order: list[int] = []
        self.prefetch_ok = True
        self.paused = False  # the hybrid engine gathered everything: hooks stand aside
        # FSDP2's reshard_after_forward for a pipeline stage, whose gradients are reduced
        # only at the end of the batch: release a unit after its forward (never kept for
        # backward) and after its backward, once every parameter's gradient accumulated
        self.reshard_after_forward = False
        self._grads_in: dict[int, set[int]] = {}
        self._handles: list[object] = []

    def install(self) -> None:
        root = self.root.module
        self._handles.append(root.register_forward_pre_hook(self._root_pre))
        self._handles.append(root.register_forward_hook(self._root_post))
        for unit in self.units[1:]:
            if not unit.flats:
                continue
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post(unit)))
            for flat in unit.flats:
                for p in flat.params:
                    if p.requires_grad:
                        hook = self._make_grad_in(unit)
                        self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()  # type: ignore[attr-defined]
        self._handles = []

    # -- primitives -----------------------------------------------------------------------
    def fetch(self, unit: Unit, what: str = "gather") -> None:
        if unit.available():
            return
        if all(f.status is ZeroParamStatus.NOT_AVAILABLE for f in unit.flats):
            with comm.set_current_tag(f"zero3.{what} unit {unit.name}"):
                self.check(unit.id + 1, f"{what} unit {unit.name}")
                for f in unit.flats:
                    f.start_gather()
        for f in unit.flats:
            f.wait_gather()

    def prefetch(self, unit: Unit) -> None:
        if not unit.flats or unit.numel > self.prefetch_numel:
            return
        if any(f.status is not ZeroParamStatus.NOT_AVAILABLE for f in unit.flats):
            return
        with comm.set_current_tag(f"zero3.prefetch unit {unit.name}"):
            self.check(unit.id + 1, f"prefetch unit {unit.name}")
            for f in unit.flats:
                f.start_gather()

    def release(self, unit: Unit) -> None:
        self.kept.discard(unit.id)
        for f in unit.flats:
            if not f.persistent:
                f.release()

    def release_all(self, include_root: bool = True) -> None:
        for unit in self.units:
            if include_root or not unit.is_root:
                self.release(unit)

    def live_numel(self) -> int:
        """Elements of sharded (non-persistent) units gathered or being gathered right now."""
        return sum(
            f.numel
            for u in self.units
            for f in u.flats
            if not f.persistent and f.status is not ZeroParamStatus.NOT_AVAILABLE
        )

    def _make_grad_in(self, unit: Unit):  # noqa: ANN202 - hook closure
        trainable = sum(p.requires_grad for f in unit.flats for p in f.params)

        def hook(param: nn.Parameter) -> None:
            if not self.reshard_after_forward or self.paused:
                return
            seen = self._grads_in.setdefault(unit.id, set())
            seen.add(id(param))
            if len(seen) == trainable:  # the unit's backward is over for this micro-batch
                self._grads_in.pop(unit.id)
                self.release(unit)

        return hook

    def keep_for_backward(self, unit: Unit) -> bool:
        """Keep ``unit`` gathered from its forward to its backward instead of re-gathering?

        ``stage3_max_reuse_distance``: the unit is reused (by its backward) after the units
        that run after it in the recorded forward order; when their parameter elements add
        up to at most the distance, releasing it would only mean gathering it again soon.
        ``stage3_max_live_parameters`` caps the gathered elements kept alive this way,
        counting the next unit of the order, which is about to be gathered. Decided from
        the previous forward's order, which every rank shares; on a changed order (or no
        recorded order yet) units are released.
        """
        pos = len(self.order) - 1
        prev = self.prev_order
        if (
            self.reshard_after_forward
            or not self.prefetch_ok
            or pos < 0
            or pos >= len(prev)
            or prev[pos] != unit.id
        ):
            return False
        later = prev[pos + 1 :]
        if sum(self.units[u].numel for u in set(later) if u != unit.id) > self.max_reuse_distance:
            return False
        upcoming = 0
        if later and not self.units[later[0]].available():
            upcoming = self.units[later[0]].numel
        return self.live_numel() + upcoming <= self.max_live_numel

    # -- hooks ------------------------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: object) -> None:
        if self.paused:
            return
        if not _in_backward():
            self.order = []
            self.prefetch_ok = True
        self.fetch(self.root)
        if not _in_backward() and self.prev_order:
            self.prefetch(self.units[self.prev_order[0]])

    def _root_post(self, module: nn.Module, args: object, output: object) -> None:
        if self.paused:
            return
        if not _in_backward():
            self.prev_order = self.order
        grad = torch.is_grad_enabled()
        for unit in self.units:  # e.g. a prefetched unit this forward did not use
            if (not unit.is_root or not grad) and not (grad and unit.id in self.kept):
                self.release(unit)

    def _make_pre(self, unit: Unit):  # noqa: ANN202 - hook closure
        def hook(module: nn.Module, args: object) -> None:
            if self.paused:
                return
            if _in_backward():  # e.g. activation-checkpoint recomputation
                self.fetch(unit, "gather (recompute)")
                return
            pos = len(self.order)
            self.order.append(unit.id)
            prev = self.prev_order
            if self.prefetch_ok and prev and (pos >= len(prev) or prev[pos] != unit.id):
                from shardspeed.utils.logging import warning_once

                warning_once(
                    "ZeRO-3: module execution order changed between forward passes; prefetch "
                    "falls back to on-demand gathering for the rest of this forward."
                )
                self.prefetch_ok = False
            self.fetch(unit)
            if self.prefetch_ok and pos + 1 < len(prev):
                self.prefetch(self.units[prev[pos + 1]])

        return hook

    def _pre_backward(self, unit: Unit, before: Unit | None) -> None:
        self._grads_in.pop(unit.id, None)  # count this backward's gradients afresh
        self.fetch(unit, "gather for backward")
        if before is not None and not before.is_root:
            self.prefetch(before)

    def _make_post(self, unit: Unit):  # noqa: ANN202 - hook closure
        def hook(module: nn.Module, args: object, output: object) -> None:
            if self.paused:
                return
            if torch.is_grad_enabled():
                leaves = torch.utils._pytree.tree_leaves(output)
                tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    # the unit that ran just before this one is the next to need its params
                    before = None
                    order = self.order
                    if not _in_backward() and self.prefetch_ok and len(order) > 1:
                        if order[-1] == unit.id:
                            before = self.units[order[-2]]
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda _grad: self._pre_backward(unit, before), mode="any"
                    )
            if _in_backward():  # a recomputation's backward still needs the params
                return
            if torch.is_grad_enabled() and self.keep_for_backward(unit):
                self.kept.add(unit.id)
                return
            self.release(unit)

        return hook
