"""The training engine: DeepSpeed's ``DeepSpeedEngine`` surface over one sharding engine.

``ShardSpeedEngine`` is orchestration only. ``__init__`` assembles policies chosen once
(mesh axes, offload, the stage's sharding layout, the optimizer and what it can do, the
reducer, the gradient norm, precision, the LR schedule); ``backward`` scales and runs
autograd while bucketed reductions overlap with it; ``step`` does nothing until the
accumulation boundary, where it runs the sharded optimizer (unscale, overflow check, clip,
update, all-gather) and the LR schedule. The rest lives beside it:

* ``engine_assembly.py``: the construction steps that are functions of config and mesh
  (each group's mesh axis, the sharding context, offload, the LR schedule);
* ``optimizer_caps.py``: the basic optimizer's capabilities, read once and checked
  against the layout (self-reducing 1-bit optimizers, per-parameter segments);
* ``grad_norm_terms.py``: which master slices the clipping norm sums over which axes;
* ``engine_state.py``: ``state_dict``/``load_state_dict`` (a tensor-parallel or the
  layout's own policy) and the master refresh after a load;
* ``engine_checkpoint_api.py``: ``save_checkpoint``/``load_checkpoint`` and the 16-bit
  model export (the format lives in :mod:`shardspeed.checkpoint`);
* ``engine_queries.py``: ``get_lr``, ``get_global_grad_norm``, ``deepspeed_io``, ...;
* ``config_getters.py``: ``train_batch_size()`` and the other config reads.

Stage differences are the layout's answers (``sharding.shards_optimizer_state``,
``allows_no_sync``, ``load_updates_masters``), never stage comparisons here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.accelerator import get_accelerator
from shardspeed.compression.engine_hook import build_compression_hook
from shardspeed.config import ShardSpeedConfig
from shardspeed.precision.cpu_support import warn_if_slow
from shardspeed.precision.loss_scaler import build_loss_scaler
from shardspeed.precision.policy import MixedPrecision
from shardspeed.runtime.compile_step import CompileApiMixin
from shardspeed.runtime.config_getters import ConfigGettersMixin
from shardspeed.runtime.engine_assembly import (
    build_lr_scheduler,
    build_offload,
    checks_overflow,
    dense_axis,
    shard_axis,
    sharding_context,
)
from shardspeed.runtime.engine_checkpoint_api import CheckpointApiMixin
from shardspeed.runtime.engine_queries import EngineQueriesMixin
from shardspeed.runtime.engine_state import EngineStateMixin, build_state_dict_policy
from shardspeed.runtime.expert_layout import split_expert_groups
from shardspeed.runtime.grad_norm_terms import build_grad_norm
from shardspeed.runtime.optimizer_caps import (
    OptimizerCaps,
    initial_zero_grad_step,
    takes_initial_zero_grad_step,
)
from shardspeed.runtime.reporting import StepReporter
from shardspeed.runtime.setup import cast_module, collect_param_groups, rebind_optimizer
from shardspeed.runtime.zero.stage3 import attach_parameter_offload
from shardspeed.topology import Topology
from shardspeed.utils.logging import get_logger, log_dist
from shardspeed.zero.grad_norm import GradNorm
from shardspeed.zero.init_partition import full_numel
from shardspeed.zero.optimizer import ShardedOptimizer, StepResult
from shardspeed.zero.reducer import GradReducer
from shardspeed.zero.sharding import build_sharding

logger = get_logger(__name__)


class ShardSpeedEngine(
    ConfigGettersMixin,
    EngineQueriesMixin,
    EngineStateMixin,
    CheckpointApiMixin,
    CompileApiMixin,
    nn.Module,
):
    """Wraps a model for sharded data-parallel training (ZeRO stages 0-3).

    Assembled from policies chosen once: the stage's sharding layout
    (:class:`~shardspeed.zero.sharding.FlatSharding` or
    :class:`~shardspeed.zero.unit_sharding.UnitSharding`), the optimizer's capabilities
    (:class:`~shardspeed.runtime.optimizer_caps.OptimizerCaps`), the gradient reduction
    (the communication seam, :mod:`shardspeed.zero.grad_reduction`), the gradient norm
    (:mod:`shardspeed.runtime.grad_norm_terms`), precision and offload.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ShardSpeedConfig,
        topology: Topology,
        *,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        replicated_params: Sequence[nn.Parameter] = (),
    ) -> None:
        super().__init__()
        self._init_state(model, config, topology, mpu)
        cast_module(model, self.device, self.precision.param_dtype)
        for module in model.modules():  # MoE layers attach to their expert groups
            attach = getattr(module, "set_deepspeed_parallelism", None)
            if callable(attach):
                attach()
        # 1. param groups; empty / frozen-only groups stay in the optimizer (schedulers and
        # checkpoints count groups, as in DeepSpeed) but hold no shard
        all_groups = collect_param_groups(model, optimizer, model_parameters)
        if optimizer is None and config.optimizer is not None and config.optimizer.type == "Muon":
            from shardspeed.ops.muon import split_muon_groups

            all_groups = split_muon_groups(model, all_groups)  # Muon / AdamW halves
        all_groups = split_expert_groups(all_groups, isinstance(optimizer, torch.optim.Optimizer))
        groups = [g for g in all_groups if g["params"]]
        self._sharded_group_mask = [bool(g["params"]) for g in all_groups]
        numel = sum(full_numel(p) for g in groups for p in g["params"])
        # 2. layout: offload, the axis of each group, the stage's sharding, state dict views
        self.offload = build_offload(
            config,
            self.precision,
            client_optimizer=optimizer,
            rank=self.global_rank,
            device=self.device,
            numel=numel,
            dp_world_size=self.dp_world_size,
        )
        self.shard_axes = [shard_axis(topology, g["params"]) for g in groups]
        ctx = sharding_context(
            config, topology, self.precision, self.shard_axes, self.device, self.offload
        )
        self.sharding = build_sharding(ctx, groups, model)
        self.flat_groups = self.sharding.groups
        self.state_dict_policy = build_state_dict_policy(topology, self.sharding)
        # 3. the user's optimizer over the flat masters, its capabilities checked once
        masters = iter([g.masters for g in self.flat_groups])
        self.basic_optimizer = rebind_optimizer(
            optimizer,
            config.optimizer,
            all_groups,
            [next(masters) if g["params"] else [] for g in all_groups],
            offload=self.offload.offload_optimizer,
        )
        self.optimizer_caps = OptimizerCaps.of(self.basic_optimizer, config.optimizer)
        self.optimizer_caps.connect(
            self.basic_optimizer,
            sharding=self.sharding,
            topology=topology,
            dp_group=self.dp_group,
            shard_axes=self.shard_axes,
            sharded_group_mask=self._sharded_group_mask,
        )
        # 4. gradients: loss scaling, reduction (the comm seam), the sharded optimizer
        self.loss_scaler = build_loss_scaler(config.fp16 if config.fp16.enabled else None)
        self.reducer = GradReducer(
            self.sharding.grad_slots(),
            [self.optimizer_caps.grad_reduction(a, self.dp_world_size) for a in self.shard_axes],
            self.sharding.reduction_policy(),
            is_boundary=self.is_gradient_accumulation_boundary,
        )
        self.sharding.reducer = self.reducer
        self.optimizer: ShardedOptimizer | None = self._build_optimizer(replicated_params)
        # 5. schedule, activation checkpointing, reporting and the optional features
        self.lr_scheduler = build_lr_scheduler(config, lr_scheduler, self.basic_optimizer)
        if config.activation_checkpointing_given:
            from shardspeed.runtime import activation_checkpointing

            activation_checkpointing.configure(mpu, deepspeed_config=config)
        self.training_dataloader = None
        self.reporter = StepReporter(self)
        self.hybrid = None  # hybrid_engine.enabled: generation phases (runtime/hybrid.py)
        if config.hybrid_engine.enabled:
            from shardspeed.runtime.hybrid import HybridGeneration

            pin = config.hybrid_engine.pin_parameters
            self.hybrid = HybridGeneration(model, self.sharding, pin_parameters=pin)
        # ZeRO-3: DeepSpeed's optimizer.parameter_offload hook handles (TRL's generation path)
        attach_parameter_offload(self)
        # compression_training: the scheduler and bit schedule, stepped with the engine
        self.compression = build_compression_hook(
            model, config.compression_training, zero_stage=self.stage
        )
        self._compile_from_config()  # compile.enabled: torch.compile of the forward
        log_dist(
            f"ShardSpeed engine: ZeRO stage {self.stage}, dp={self.dp_world_size}, "
            f"{self.sharding.describe()}, param dtype {self.precision.param_dtype}, "
            f"{numel:,} trainable parameters, "
            f"micro batch {config.train_micro_batch_size_per_gpu}, "
            f"GAS {config.gradient_accumulation_steps}, {self.offload.policy.describe()}"
        )

    # -- construction helpers ------------------------------------------------------------
    def _init_state(
        self, model: nn.Module, config: ShardSpeedConfig, topology: Topology, mpu: Any
    ) -> None:
        """Identity (ranks, mesh axes, device, precision) and step counters."""
        self.module = model
        self._config = config
        self.config = config.raw
        self.mpu = mpu
        self.topology = topology
        self.local_rank = comm.get_local_rank()
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.dp_group = dp_group = topology.group("data")
        self.dp_world_size = topology.size("data")
        self.dp_rank = topology.rank_in("data")
        self.mp_world_size = self.world_size // self.dp_world_size
        self.device = get_accelerator().device(self.local_rank)
        self.precision = MixedPrecision.from_config(config)
        warn_if_slow(self.precision.param_dtype, self.device)
        self.stage = config.zero_optimization.stage
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._last_step: StepResult | None = None
        self._in_no_sync = False
        self.collective_check = comm.CollectiveSequenceCheck.from_config(
            config.collective_check, dp_group, self.device
        )

    def _build_optimizer(self, replicated: Sequence[nn.Parameter]) -> ShardedOptimizer | None:
        """The sharded optimizer over the layout's groups (None without a basic optimizer),
        stepped once with zero gradients where DeepSpeed's 16-bit ZeRO-0 wrappers do."""
        if self.basic_optimizer is None:
            return None
        optimizer = ShardedOptimizer(
            self.basic_optimizer,
            self.flat_groups,
            self.reducer,
            publish=self.sharding.publish,
            grad_norm=self._grad_norm(replicated),
            loss_scaler=self.loss_scaler,
            gradient_clipping=self._config.gradient_clipping,
            check_overflow=checks_overflow(self._config, self.precision),
        )
        dtype, sharded = self.precision.param_dtype, self.sharding.shards_optimizer_state
        if takes_initial_zero_grad_step(self._config, sharded, dtype, self.module):
            initial_zero_grad_step(optimizer, dtype, self.global_rank)
        return optimizer

    def _grad_norm(self, replicated: Sequence[nn.Parameter]) -> GradNorm:
        """The clipping norm's per-axis terms (:mod:`shardspeed.runtime.grad_norm_terms`);
        ``replicated`` parameters are counted by another rank (a pipeline's tied copies)."""
        return build_grad_norm(
            self.topology,
            self.flat_groups,
            dense_axis=dense_axis(self.topology),
            sharded=self.sharding.shards_optimizer_state,
            local_grads=self.optimizer_caps.reduces_gradients,
            replicated=replicated,
            moe_grad_norm=self._config.moe.grad_norm,
            low_precision=self.precision.param_dtype != torch.float32,
            fused_adam=self.optimizer_caps.fused_adam,
            device=self.device,
        )

    # -- forward / backward / step -------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.reporter.before_forward()
        if self.compression is not None:
            self.compression.before_forward(self.global_steps)
        out = self.module(*args, **kwargs)
        self.reporter.after_forward()
        return out

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as ``backward`` would differentiate it (1/GAS and loss scale applied)."""
        gas = self._config.gradient_accumulation_steps
        if gas > 1:
            loss = loss / gas
        if self.loss_scaler.loss_scale != 1.0:
            loss = loss * self.loss_scaler.loss_scale
        return loss

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Back-propagate ``loss`` (divided by GAS, times the loss scale); returns ``loss``."""
        self.reporter.start("backward")
        scaled = loss / self._config.gradient_accumulation_steps if scale_wrt_gas else loss
        self.reporter.record_loss(loss)
        if self.loss_scaler.loss_scale != 1.0:
            scaled = scaled * self.loss_scaler.loss_scale
        scaled.backward(retain_graph=retain_graph)
        self.reporter.start("backward_reduce")
        self.reducer.flush()
        self.reporter.stop("backward_reduce")
        self.reporter.stop("backward")
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-step that ends an accumulation window."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self._config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the boundary state (used by accelerate); reset after the next ``step``."""
        self._boundary_override = bool(is_boundary)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Optimizer step at the accumulation boundary; otherwise only counts the micro-step."""
        if self._in_no_sync:
            raise RuntimeError(
                "engine.step() was called inside engine.no_sync(); gradients were not reduced. "
                "Leave the no_sync() block before stepping."
            )
        self.reducer.flush()  # no-op when backward() already completed the reduction
        if self.is_gradient_accumulation_boundary():
            self._take_optimizer_step(lr_kwargs or {})
        self.micro_steps += 1
        self._boundary_override = None

    def _take_optimizer_step(self, lr_kwargs: dict[str, Any]) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                "engine.step() needs an optimizer: pass optimizer= to initialize() or add an "
                "'optimizer' block to the config."
            )
        self.reporter.start("step")
        with comm.set_current_tag("optimizer.step"):  # labels the norm / all-gather collectives
            self._last_step = self.optimizer.step()
        if self.compression is not None:
            self.compression.after_optimizer_step(self._last_step.applied)
        if self._last_step.applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        else:
            self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self._config.train_batch_size
        self.reporter.stop("step")
        self.reporter.after_step()
        self.collective_check.step_boundary(self.global_steps)  # debug: ranks' sequences agree?

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            for g in self.flat_groups:
                g.zero_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction for backward passes inside the block (stages 0 and 1)."""
        if not self.sharding.allows_no_sync:
            raise RuntimeError(
                f"no_sync() is incompatible with zero_optimization.stage={self.stage}: gradients "
                "are reduce-scattered as they are produced. Use gradient_accumulation_steps."
            )
        self.set_gradient_reduction(False)
        self._in_no_sync = True
        try:
            yield
        finally:
            self.set_gradient_reduction(True)
            self._in_no_sync = False

    def set_gradient_reduction(self, enabled: bool) -> None:
        """Reduce gradients during ``backward`` (default) or leave them to accumulate locally
        until :meth:`allreduce_gradients` (the pipeline schedule reduces once per batch)."""
        self.reducer.sync_enabled = enabled

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """Reduce the locally accumulated gradients now, as on an accumulation boundary
        (``bucket_size``: DeepSpeed's; buckets are laid out once from ``reduce_bucket_size``)."""
        self.set_gradient_reduction(True)
        self._boundary_override = True
        self.reducer.flush()

    # -- lifecycle ---------------------------------------------------------------------------
    def train(self, mode: bool = True) -> ShardSpeedEngine:
        self.module.train(mode)
        self.training = mode
        return self

    def destroy(self) -> None:
        """Remove hooks and drop references (accelerate calls this).

        Waits for an asynchronous checkpoint save and raises if it failed.
        """
        self.sharding.remove()
        self.reducer.remove_hooks()
        if self.hybrid is not None:
            self.hybrid.remove()
        self.reporter.close()
        self.wait_checkpoint()
        self.offload.close()  # finish swap I/O, delete swap files


DeepSpeedEngine = ShardSpeedEngine  # DeepSpeed's name (isinstance checks in Accelerate)
