"""ZeRO stage 3: parameters, gradients and optimizer state all sharded over the dp group.

Stage 3 is a policy of the same engine as stages 0-2 (FSDP2-like): the model is split
into *units* (each element of an ``nn.ModuleList``/``nn.Sequential``, plus a root unit for
the rest); each unit's parameters live as 1/N shards (:mod:`shardspeed.zero.params`),
are all-gathered around the unit's forward and backward, and their gradients are
reduce-scattered into fp32/grad shards at every micro-step. The optimizer step is the
one of :class:`~shardspeed.zero.optimizer.ShardedOptimizer` over per-unit master shards,
without the all-gather after the step: parameters are gathered again on next use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.config import ShardSpeedConfig
from shardspeed.precision.loss_scaler import build_loss_scaler
from shardspeed.runtime.engine import ShardSpeedEngine
from shardspeed.runtime.reporting import StepReporter
from shardspeed.runtime.setup import cast_module, collect_param_groups, rebind_optimizer
from shardspeed.utils.logging import get_logger, log_dist
from shardspeed.zero.init_partition import full_numel, materialize_init_params
from shardspeed.zero.optimizer import ShardedOptimizer
from shardspeed.zero.params import FetchCoordinator, OrderCheck, ShardedFlat, Unit
from shardspeed.zero.stage3_reducer import Stage3Reducer

logger = get_logger(__name__)

_CONTAINERS = (nn.ModuleList, nn.Sequential)
PERSISTENT_CODE = 1_000_000


def split_units(model: nn.Module) -> list[Unit]:
    """Root unit first, then every parameter-owning child of a ModuleList/Sequential."""
    units = [Unit(0, "", model, is_root=True)]

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(module, _CONTAINERS) and any(True for _ in child.parameters()):
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


class Stage3Group:
    """One optimizer param group as ShardedOptimizer sees it: one "bucket" per flat."""

    def __init__(self, flats: list[ShardedFlat]) -> None:
        self.flats = flats

    @property
    def buckets(self) -> list[ShardedFlat]:
        return self.flats

    @property
    def masters(self) -> list[torch.Tensor]:
        return [f.master for f in self.flats]

    @property
    def device(self) -> torch.device:
        return self.flats[0].device

    @property
    def offload(self) -> Any:
        """The engine's OffloadRuntime (the optimizer asks it for the NVMe swapper)."""
        return self.flats[0].offload if self.flats else None

    def shard_grad(self, flat: ShardedFlat) -> torch.Tensor:
        return flat.optimizer_grad()

    def optimizer_grad(self, flat: ShardedFlat) -> torch.Tensor:
        return flat.optimizer_grad()

    def param_shard(self, flat: ShardedFlat) -> torch.Tensor:
        return flat.shard

    def zero_grads(self) -> None:
        for f in self.flats:
            f.zero_grad_shard()

    def copy_masters_to_params(self) -> None:
        for f in self.flats:
            f.copy_master_to_shard()

    def copy_master_to_params(self, index: int) -> None:
        self.flats[index].copy_master_to_shard()

    def storage_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.flats:
            for key, value in f.storage_bytes().items():
                out[key] = out.get(key, 0) + value
        return out


class Stage3Optimizer(ShardedOptimizer):
    """ShardedOptimizer over per-unit master shards; no all-gather after the step."""

    persistent: list[ShardedFlat]
    coordinator: FetchCoordinator
    check: OrderCheck
    device: torch.device

    def _publish_params(self) -> None:
        self._copy_masters_to_params()
        self.coordinator.release_all()  # stale full buffers; gathered again on next use
        for i, flat in enumerate(self.persistent):
            flat.release()
            self.check(-(PERSISTENT_CODE + i), f"gather persistent flat {i}")
            flat.gather()

    def _global_grad_norm(self) -> float:
        grads = self.master_grads()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch._foreach_norm(grads, 2.0)
            sq += torch.stack([n.float() for n in norms]).pow(2).sum().to(self.device)
        if self.dp_world_size > 1:
            comm.all_reduce(sq, group=self.dp_group)
        return float(sq.sqrt())


class Stage3Engine(ShardSpeedEngine):
    """ZeRO stage 3 engine: same surface as :class:`ShardSpeedEngine`, parameters sharded."""

    def __init__(
        self,
        model: nn.Module,
        config: ShardSpeedConfig,
        *,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        dp_group: Any = None,
    ) -> None:
        nn.Module.__init__(self)
        self._init_state(model, config, mpu, dp_group)
        zc = config.zero_optimization

        cast_module(model, self.device, self.precision.param_dtype)
        groups = collect_param_groups(model, optimizer, model_parameters)
        self.offload = self._build_offload(
            optimizer, sum(full_numel(p) for g in groups for p in g["params"])
        )
        self.units = split_units(model)
        self.persistent_flats: list[ShardedFlat] = []
        self.flat_groups = self._build_flats(groups, model)
        self.basic_optimizer = rebind_optimizer(
            optimizer,
            config.optimizer,
            groups,
            [g.masters for g in self.flat_groups],
            offload=self.offload.offload_optimizer,
        )
        self.loss_scaler = build_loss_scaler(config.fp16 if config.fp16.enabled else None)
        check_on = os.environ.get("SHARDSPEED_ZERO3_ORDER_CHECK", "1") != "0"
        self.order_check = OrderCheck(dp_group, self.dp_world_size, self.device, check_on)
        self.coordinator = FetchCoordinator(
            self.units,
            self.order_check,
            int(zc.stage3_prefetch_bucket_size),
            max_live_numel=int(zc.stage3_max_live_parameters),
            max_reuse_distance=int(zc.stage3_max_reuse_distance),
        )
        self.coordinator.install()
        pre = config.gradient_predivide_factor if config.prescale_gradients else 1.0
        self.reducer = Stage3Reducer(
            self.units,
            self.persistent_flats,
            self.coordinator,
            check=self.order_check,
            dp_group=dp_group,
            world=self.dp_world_size,
            reduce_dtype=self.precision.reduce_dtype,
            pre_factor=pre,
            is_boundary=self.is_gradient_accumulation_boundary,
        )
        self.optimizer = None
        if self.basic_optimizer is not None:
            self._check_optimizer_supported(self.basic_optimizer)
            opt = Stage3Optimizer(
                self.basic_optimizer,
                self.flat_groups,  # type: ignore[arg-type]
                self.reducer,  # type: ignore[arg-type]
                stage=3,
                dp_group=dp_group,
                dp_world_size=self.dp_world_size,
                loss_scaler=self.loss_scaler,
                gradient_clipping=config.gradient_clipping,
                check_overflow=self._checks_overflow(),
            )
            opt.persistent = self.persistent_flats
            opt.coordinator = self.coordinator
            opt.check = self.order_check
            opt.device = self.device
            self.optimizer = opt
        self.lr_scheduler = self._build_lr_scheduler(lr_scheduler)
        self.training_dataloader = None
        self.reporter = StepReporter(self)
        n_params = sum(p.ds_numel for g in groups for p in g["params"])
        log_dist(
            f"ShardSpeed engine: ZeRO stage 3, dp={self.dp_world_size}, "
            f"{len(self.units)} units, {len(self.persistent_flats)} persistent flats, "
            f"param dtype {self.precision.param_dtype}, {n_params:,} trainable parameters, "
            f"{self.offload.policy.describe()}"
        )

    def _build_flats(self, groups: list[dict[str, Any]], model: nn.Module) -> list[Stage3Group]:
        zc = self._config.zero_optimization
        p = self.precision
        owner = assign_params(model, self.units)
        threshold = int(zc.stage3_param_persistence_threshold)
        budget = int(zc.stage3_model_persistence_threshold)
        common = {
            "dp_group": self.dp_group,
            "world": self.dp_world_size,
            "rank": self.dp_rank,
            "param_dtype": p.param_dtype,
            "grad_dtype": p.grad_dtype(self._config.gradient_accumulation_steps),
            "master_dtype": p.master_dtype,
            "device": self.device,
            "offload": self.offload,
        }
        next_id = 0
        out = []
        for g in groups:
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
                    flat = ShardedFlat(
                        params, unit_id=unit.id, first_param_id=next_id, persistent=False, **common
                    )
                    unit.flats.append(flat)
                    flats.append(flat)
                    next_id += len(params)
            if keep:
                flat = ShardedFlat(
                    keep, unit_id=-1, first_param_id=next_id, persistent=True, **common
                )
                self.persistent_flats.append(flat)
                flats.append(flat)
                next_id += len(keep)
            out.append(Stage3Group(flats))
        # the flats adopted the trainable zero.Init pieces; frozen params stay whole (replicated)
        materialize_init_params(model, "ZeRO-3 keeps frozen parameters whole on every rank")
        return out

    # -- queries -----------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The full (gathered) module state dict, on every rank (a collective call)."""
        from shardspeed.zero.init import GatheredParameters

        with GatheredParameters(list(self.module.parameters())):
            state = self.module.state_dict(*args, **kwargs)
            return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a full state dict (every rank passes the same one); updates shards and masters."""
        from shardspeed.zero.init import GatheredParameters

        with GatheredParameters(list(self.module.parameters()), modifier_rank=0):
            return self.module.load_state_dict(state_dict, strict=strict)

    # -- checkpoint hooks (see shardspeed.checkpoint.shards) ---------------------------------
    def checkpoint_master_fragments(self) -> Iterator[Any]:
        """This rank's master fragments of every sharded flat (checkpoint save/load hook)."""
        from shardspeed.zero.stage3_checkpoint import stage3_master_fragments

        return stage3_master_fragments(self)

    def checkpoint_publish_params(self) -> None:
        """Refresh parameter shards (and persistent gathered copies) from the masters."""
        from shardspeed.zero.stage3_checkpoint import stage3_publish_params

        stage3_publish_params(self)

    def destroy(self) -> None:
        """Remove the gather/release hooks, then what every engine releases (reducer hooks,
        reporter, a pending asynchronous checkpoint save, offload swap files)."""
        self.coordinator.remove()
        super().destroy()
