"""Stage 3 as a sharding policy: parameters sharded per module unit, gathered around use.

The model is split into *units* (each element of an ``nn.ModuleList``/``nn.Sequential``,
plus a root unit for the rest and for parameters shared between units). Each (unit,
param group) becomes one :class:`~shardspeed.zero.flat_buffer.FlatGroup` with a gathered
residency (:class:`~shardspeed.zero.residency.GatheredResidency`): a single padded bucket
of which this rank keeps slice ``dp_rank``, the same flat-buffer type stages 0-2 use. The
:class:`~shardspeed.zero.fetch.FetchCoordinator` gathers a unit before its forward and
backward (prefetching the next unit of the recorded order) and releases it after; the
reducer releases a unit once all its gradients are reduced. Parameters below
``stage3_param_persistence_threshold`` stay gathered in a *persistent* flat.

ZeRO++ (:mod:`shardspeed.zero.zeropp`) is wired here: the dense unit flats gather through
its :class:`~shardspeed.zero.zeropp.weights.WeightGathers` (qwZ, hpZ), and when the engine
hands over its reducer (:attr:`UnitSharding.reducer`) the dense param groups' reductions
become qgZ's quantized all-to-alls.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from shardspeed.utils.logging import log_dist
from shardspeed.zero.fetch import FetchCoordinator, Unit
from shardspeed.zero.flat_buffer import FlatGroup, GatherSpec
from shardspeed.zero.flat_slot import FlatBucket
from shardspeed.zero.init_partition import full_numel, init_state, materialize_init_params
from shardspeed.zero.order_check import OrderCheck
from shardspeed.zero.reducer import GradSlot, ReductionPolicy
from shardspeed.zero.sharding import ShardingContext
from shardspeed.zero.zeropp import ZeroPPPolicy
from shardspeed.zero.zeropp.weights import ComputeGatherCoordinator

_CONTAINERS = (nn.ModuleList, nn.Sequential)
PERSISTENT_CODE = 1_000_000  # order-check codes of persistent-flat gathers: -(CODE + i)


def _is_unit_container(module: nn.Module) -> bool:
    """ModuleList/Sequential, or a module that declares its children to be its layers
    (``zero3_unit_container = True``: a pipeline stage, whose layers are attributes)."""
    return isinstance(module, _CONTAINERS) or getattr(module, "zero3_unit_container", False)


def split_units(model: nn.Module) -> list[Unit]:
    """Root unit first, then every parameter-owning child of a unit container (a
    ModuleList/Sequential or a module with ``zero3_unit_container``). A ModuleDict child
    is never a unit: it has no forward, its modules are called by others."""
    units = [Unit(0, "", model, is_root=True)]

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if (
                _is_unit_container(module)
                and not isinstance(child, nn.ModuleDict)
                and any(True for _ in child.parameters())
            ):
                units.append(Unit(len(units), full, child, is_root=False))
            else:
                visit(full, child)

    visit("", model)
    return units


def assign_params(model: nn.Module, units: list[Unit]) -> dict[int, int]:
    """id(param) -> unit index; parameters used by modules of several units go to the root."""
    module_unit = {id(u.module): u.id for u in units}
    owners: dict[int, set[int]] = {}

    def visit(module: nn.Module, unit_id: int) -> None:
        unit_id = module_unit.get(id(module), unit_id)
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(unit_id)
        for p in getattr(module, "_ss_external_params", {}).values():
            owners.setdefault(id(p), set()).add(0)
        for child in module.children():
            visit(child, unit_id)

    visit(model, 0)
    return {pid: (next(iter(us)) if len(us) == 1 else 0) for pid, us in owners.items()}


class UnitGroup:
    """One optimizer param group at stage 3: one single-bucket flat per unit (+ persistent).

    Offers the optimizer the same surface as one :class:`FlatGroup` of several buckets,
    each flat being one bucket.
    """

    def __init__(self, flats: list[FlatGroup]) -> None:
        self.flats = flats

    @property
    def buckets(self) -> list[FlatGroup]:
        return self.flats

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for f in self.flats for p in f.params]

    @property
    def masters(self) -> list[torch.Tensor]:
        return [f.masters[0] for f in self.flats]

    @property
    def device(self) -> torch.device:
        return self.flats[0].device

    @property
    def offload(self) -> Any:
        """The engine's OffloadRuntime (the optimizer asks it for the NVMe swapper)."""
        return self.flats[0].offload if self.flats else None

    def layouts(self) -> Iterator[tuple[Any, int, list[nn.Parameter], list, int]]:
        """One single-bucket layout per flat (see ``zero.fragments.param_fragments``)."""
        for index, flat in enumerate(self.flats):
            yield flat.layout, flat.shard_rank, flat.params, list(flat.shapes), index

    def shard_grad(self, flat: FlatGroup) -> torch.Tensor:
        return flat.shard_grad(flat.buckets[0])

    def is_gathered(self, index: int) -> bool:
        return self.flats[index].full is not None

    def optimizer_grad(self, flat: FlatGroup) -> torch.Tensor:
        return flat.optimizer_grad(flat.buckets[0])

    def stage_host_grad(self, flat: FlatGroup) -> None:
        flat.stage_host_grad(flat.buckets[0])

    def zero_grads(self) -> None:
        for f in self.flats:
            f.zero_grads()

    def copy_masters_to_params(self) -> None:
        for f in self.flats:
            f.copy_masters_to_params()

    def copy_master_to_params(self, index: int) -> None:
        self.flats[index].copy_master_to_params(0)

    def storage_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.flats:
            for key, value in f.storage_bytes().items():
                out[key] = out.get(key, 0) + value
        return out


class UnitSharding:
    """Stage 3: per-unit sharded flats, gathered around use and released after."""

    def __init__(self, ctx: ShardingContext, groups: list[dict[str, Any]], model: nn.Module):
        self.ctx = ctx
        zc = ctx.zero
        self.units = split_units(model)
        self.persistent_flats: list[FlatGroup] = []
        self._slots: dict[int, FlatBucket] = {}  # id(flat) -> its reducer slot
        self._unit_of_slot: dict[int, int] = {}  # id(slot) -> unit id (-1: persistent)
        self.zeropp_policy = _with_init_qwz(ZeroPPPolicy.from_config(zc), model)
        self.zeropp = self.zeropp_policy.build(ctx.dp_group, ctx.dp_world_size)
        self.groups = self._build_groups(groups, model)
        check_on = os.environ.get("SHARDSPEED_ZERO3_ORDER_CHECK", "1") != "0"
        self.order_check = OrderCheck(ctx.dp_group, ctx.dp_world_size, ctx.device, check_on)
        coordinator_type = FetchCoordinator if self.zeropp is None else ComputeGatherCoordinator
        self.coordinator = coordinator_type(
            self.units,
            self.order_check,
            int(zc.stage3_prefetch_bucket_size),
            max_live_numel=int(zc.stage3_max_live_parameters),
            max_reuse_distance=int(zc.stage3_max_reuse_distance),
        )
        self.coordinator.install()
        self._reducer: Any = None  # set by the engine; on_ready asks it which flats are done

    @property
    def reducer(self) -> Any:
        return self._reducer

    @reducer.setter
    def reducer(self, reducer: Any) -> None:
        """The engine's gradient reducer; with qgZ its dense param groups' reductions are
        replaced by :class:`~shardspeed.zero.zeropp.grads.QuantizedReduction`."""
        self._reducer = reducer
        if self.zeropp is None or reducer is None:
            return
        reducer.reductions = [
            self.zeropp.grad_reduction(r) if self._dense(axis) else r
            for r, axis in zip(reducer.reductions, self.ctx.axes)
        ]

    def _dense(self, axis: Any) -> bool:
        """The param group is sharded over the data axis (not an expert-data axis)."""
        return axis.group is self.ctx.dp_group and axis.size == self.ctx.dp_world_size

    def _build_groups(self, groups: list[dict[str, Any]], model: nn.Module) -> list[UnitGroup]:
        ctx, zc = self.ctx, self.ctx.zero
        owner = assign_params(model, self.units)
        threshold = int(zc.stage3_param_persistence_threshold)
        budget = int(zc.stage3_model_persistence_threshold)
        next_id = 0
        out = []
        for group_index, (g, axis) in enumerate(zip(groups, ctx.axes)):
            per_unit: list[list[nn.Parameter]] = [[] for _ in self.units]
            keep: list[nn.Parameter] = []
            for param in g["params"]:
                numel = full_numel(param)  # ds_numel of a zero.Init-partitioned param
                if numel < threshold and numel <= budget:
                    budget -= numel
                    keep.append(param)
                else:
                    per_unit[owner.get(id(param), 0)].append(param)
            flats = []
            for unit, params in zip(self.units, per_unit):
                if params:
                    flat = self._new_flat(params, axis, group_index, unit.id, next_id)
                    flat.label = f"unit {unit.name}"
                    unit.flats.append(flat)
                    flats.append(flat)
                    next_id += len(params)
            if keep:
                flat = self._new_flat(keep, axis, group_index, -1, next_id)
                flat.label = "<persistent>"
                self.persistent_flats.append(flat)
                flats.append(flat)
                next_id += len(keep)
            out.append(UnitGroup(flats))
        # the flats adopted the trainable zero.Init pieces; frozen params stay whole (replicated)
        materialize_init_params(model, "ZeRO-3 keeps frozen parameters whole on every rank")
        return out

    def _new_flat(
        self, params: list[nn.Parameter], axis: Any, group_index: int, unit_id: int, first_id: int
    ) -> FlatGroup:
        """One unit's (``unit_id`` -1: the persistent) parameters of one param group."""
        ctx = self.ctx
        flat = FlatGroup(
            params,
            shard_world_size=axis.size,
            shard_rank=axis.rank,
            bucket_size=0,  # one bucket per flat (set by the gathered residency)
            param_dtype=ctx.param_dtype,
            grad_dtype=ctx.grad_dtype,
            master_dtype=ctx.master_dtype,
            full_grads=False,
            device=ctx.device,
            offload=ctx.offload,
            gathered=GatherSpec(axis.group, unit_id, first_id, persistent=unit_id < 0),
        )
        flat.group_index = group_index
        if self.zeropp is not None and unit_id >= 0 and self._dense(axis):
            gathers = self.zeropp.weight_gathers(ctx.param_dtype, ctx.device)
            if gathers is not None:
                flat.residency.use_gathers(gathers)  # type: ignore[union-attr]
        return flat

    def describe(self) -> str:
        text = f"{len(self.units)} units, {len(self.persistent_flats)} persistent flats"
        return text if self.zeropp is None else f"{text}, {self.zeropp_policy.describe()}"

    # -- reduction ------------------------------------------------------------------------
    def grad_slots(self) -> list[GradSlot]:
        """One slot per flat (one bucket each): deepest unit first (backward order), the
        root, then the persistent flats."""
        flats = [f for u in reversed(self.units) for f in u.flats] + self.persistent_flats
        slots = [f.grad_slots(f.group_index)[0] for f in flats]
        self._slots = {id(f): s for f, s in zip(flats, slots)}
        self._unit_of_slot = {id(s): f.unit_id for f, s in zip(flats, slots)}
        return list(slots)

    def reduction_policy(self) -> ReductionPolicy:
        ctx = self.ctx
        return ReductionPolicy(
            every_micro_step=True,
            reduce_dtype=ctx.reduce_dtype,
            overlap=ctx.overlap,
            pre_factor=ctx.pre_factor,
            check=self.order_check,
            on_ready=self._on_flat_ready,
            after_flush=self.coordinator.release_all,
            tag="zero3.reduce_grads",
        )

    def _on_flat_ready(self, slot: GradSlot) -> None:
        unit_id = self._unit_of_slot.get(id(slot), -1)
        if unit_id > 0:
            unit = self.units[unit_id]
            if all(self.reducer.is_ready(self._slots[id(f)]) for f in unit.flats):
                self.coordinator.release(unit)  # its backward is over

    # -- after a step / a checkpoint load ----------------------------------------------------
    @torch.no_grad()
    def publish(self) -> None:
        """Masters are in the shards: drop stale gathered copies (and ZeRO++ secondary
        copies), re-gather persistent flats."""
        self.coordinator.release_all()  # gathered again on next use
        for unit in self.units:
            for flat in unit.flats:
                flat.residency.shard_changed()  # type: ignore[union-attr]
        for i, flat in enumerate(self.persistent_flats):
            flat.release()
            self.order_check(-(PERSISTENT_CODE + i), f"gather persistent flat {i}")
            flat.gather()

    # -- whole-model views --------------------------------------------------------------------
    def full_state_dict(self, module: nn.Module, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The full (gathered) module state dict, on every rank (a collective call)."""
        from shardspeed.zero.init import GatheredParameters

        with GatheredParameters(list(module.parameters())):
            state = module.state_dict(*args, **kwargs)
            return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def load_full_state_dict(self, module: nn.Module, state_dict: Any, strict: bool) -> Any:
        """Load a full state dict (every rank passes the same one); updates shards and masters."""
        from shardspeed.zero.init import GatheredParameters

        with GatheredParameters(list(module.parameters()), modifier_rank=0):
            return module.load_state_dict(state_dict, strict=strict)

    def remove(self) -> None:
        """Remove the gather/release hooks."""
        self.coordinator.remove()

    # -- what the engine asks of the layout ------------------------------------------------
    @property
    def shards_optimizer_state(self) -> bool:
        """Always: each rank holds and steps only its slice of every flat."""
        return True

    @property
    def allows_no_sync(self) -> bool:
        """Never: gradients are reduce-scattered into shards as they are produced."""
        return False

    @property
    def load_updates_masters(self) -> bool:
        """Loading gathers the units and writes back into shards and masters on exit."""
        return True


def _with_init_qwz(policy: ZeroPPPolicy, model: nn.Module) -> ZeroPPPolicy:
    """qwZ on when parameters were built under ``zero.Init(zero_quantized_weights=True)``
    (DeepSpeed: the Init argument or the config key), logged once."""
    if policy.quantized_weights:
        return policy
    states = (init_state(p) for p in model.parameters())
    if not any(s is not None and s.quantized_weights for s in states):
        return policy
    log_dist(
        "ZeRO++ qwZ on: the model was built under zero.Init(zero_quantized_weights=True) "
        "(zero_optimization.zero_quantized_weights is not set)",
        ranks=[0],
    )
    return dataclasses.replace(policy, quantized_weights=True)
