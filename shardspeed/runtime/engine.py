"""The training engine: DeepSpeed's ``DeepSpeedEngine`` surface over one sharding engine.

``backward`` scales and runs autograd while bucketed reductions overlap with it;
``step`` does nothing until the accumulation boundary, where it runs the sharded
optimizer (unscale, overflow check, clip, update, all-gather) and the LR schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.accelerator import get_accelerator
from shardspeed.compression.engine_hook import build_compression_hook
from shardspeed.config import ShardSpeedConfig
from shardspeed.precision.loss_scaler import build_loss_scaler
from shardspeed.precision.policy import MixedPrecision
from shardspeed.runtime.config_getters import ConfigGettersMixin
from shardspeed.runtime.expert_layout import (
    expert_axis,
    expert_name,
    expert_norm_groups,
    split_expert_groups,
    uses_fused_adam,
)
from shardspeed.runtime.memory import memory_breakdown
from shardspeed.runtime.pipe.module import PipelineModule
from shardspeed.runtime.reporting import StepReporter
from shardspeed.runtime.setup import cast_module, collect_param_groups, rebind_optimizer
from shardspeed.runtime.zero.stage3 import attach_parameter_offload
from shardspeed.topology import Topology
from shardspeed.utils.logging import get_logger, info_once, log_dist
from shardspeed.zero.fragments import param_fragments
from shardspeed.zero.grad_norm import GradNorm, NormTerm
from shardspeed.zero.grad_reduction import BucketedReduction, GradReduction, LocalGradients
from shardspeed.zero.init_partition import full_numel
from shardspeed.zero.offload import OffloadRuntime
from shardspeed.zero.optimizer import ShardedOptimizer, StepResult
from shardspeed.zero.reducer import GradReducer
from shardspeed.zero.sharding import ShardAxis, ShardingContext, build_sharding

logger = get_logger(__name__)


class ShardSpeedEngine(ConfigGettersMixin, nn.Module):
    """Wraps a model for sharded data-parallel training (ZeRO stages 0-3).

    Assembled from policies chosen once: the stage's sharding layout
    (:class:`~shardspeed.zero.sharding.FlatSharding` or
    :class:`~shardspeed.zero.unit_sharding.UnitSharding`), the gradient reduction (the
    communication seam, :mod:`shardspeed.zero.grad_reduction`), the gradient norm
    (:class:`~shardspeed.zero.grad_norm.GradNorm`), precision and offload.
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
        all_groups = collect_param_groups(model, optimizer, model_parameters)
        all_groups = split_expert_groups(all_groups, isinstance(optimizer, torch.optim.Optimizer))
        # empty / frozen-only groups stay in the optimizer (schedulers and checkpoints count
        # groups, as in DeepSpeed) but hold no shard: only the others are sharded
        groups = [g for g in all_groups if g["params"]]
        numel = sum(full_numel(p) for g in groups for p in g["params"])
        self.offload = self._build_offload(optimizer, numel)
        self.shard_axes = [self._shard_axis(g) for g in groups]
        self.sharding = build_sharding(self._sharding_context(), groups, model)
        self.flat_groups = self.sharding.groups
        masters = iter([g.masters for g in self.flat_groups])
        self.basic_optimizer = rebind_optimizer(
            optimizer,
            config.optimizer,
            all_groups,
            [next(masters) if g["params"] else [] for g in all_groups],
            offload=self.offload.offload_optimizer,
        )
        self._sharded_group_mask = [bool(g["params"]) for g in all_groups]
        self._attach_self_reducing_optimizer()
        self._give_param_segments()
        self.loss_scaler = build_loss_scaler(config.fp16 if config.fp16.enabled else None)
        self.reducer = GradReducer(
            self.sharding.grad_slots(),
            [self._grad_reduction(axis) for axis in self.shard_axes],
            self.sharding.reduction_policy(),
            is_boundary=self.is_gradient_accumulation_boundary,
        )
        self.sharding.reducer = self.reducer
        self.optimizer: ShardedOptimizer | None = None
        if self.basic_optimizer is not None:
            self._check_optimizer_supported(self.basic_optimizer)
            self.optimizer = ShardedOptimizer(
                self.basic_optimizer,
                self.flat_groups,
                self.reducer,
                publish=self.sharding.publish,
                grad_norm=self._grad_norm(replicated_params),
                loss_scaler=self.loss_scaler,
                gradient_clipping=config.gradient_clipping,
                check_overflow=self._checks_overflow(),
            )
            if self._takes_initial_zero_grad_step():
                self._initial_zero_grad_step()
        self.lr_scheduler = self._build_lr_scheduler(lr_scheduler)
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
        dp_group = topology.group("data")
        self.dp_group = dp_group
        self.dp_world_size = topology.size("data")
        self.dp_rank = topology.rank_in("data")
        self.mp_world_size = self.world_size // self.dp_world_size
        self.device = get_accelerator().device(self.local_rank)
        self.precision = MixedPrecision.from_config(config)
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

    def _sharding_context(self) -> ShardingContext:
        p, config = self.precision, self._config
        return ShardingContext(
            stage=self.stage,
            dp_group=self.topology.group(self._dense_axis()),
            dp_world_size=self.topology.size(self._dense_axis()),
            axes=self.shard_axes,
            device=self.device,
            param_dtype=p.param_dtype,
            grad_dtype=p.grad_dtype(config.gradient_accumulation_steps),
            reduce_dtype=p.reduce_dtype,
            master_dtype=p.master_dtype,
            offload=self.offload,
            zero=config.zero_optimization,
            overlap=config.zero_optimization.overlap_comm,
            pre_factor=config.gradient_predivide_factor if config.prescale_gradients else 1.0,
        )

    def _attach_self_reducing_optimizer(self) -> None:
        """An optimizer that averages gradients itself (1-bit Adam family) gets the data
        group and, if it normalises per parameter (1-bit LAMB), where each parameter sits
        in the flat masters. Such optimizers step whole buckets: ZeRO >= 1 is refused."""
        opt = self.basic_optimizer
        if not getattr(opt, "reduces_gradients", False):
            return
        if self.stage >= 1:
            raise ValueError(
                f"optimizer {type(opt).__name__} compresses its own gradient communication "
                f"and needs whole parameters, but zero_optimization.stage={self.stage} shards "
                "them. Fix: set zero_optimization.stage to 0 (as DeepSpeed requires)."
            )
        opt.comm_group = self.dp_group

    def _give_param_segments(self) -> None:
        """Optimizers with per-parameter norms (LAMB, 1-bit LAMB) step flat masters: tell them
        where each parameter sits (``(offset, numel, index in its group)`` per master) and,
        at ZeRO >= 1, the shard axis whose ranks hold the parameter's other elements."""
        opt = self.basic_optimizer
        if not hasattr(opt, "set_param_segments"):
            return
        if self.topology.size("tensor") > 1:
            raise ValueError(
                f"optimizer {type(opt).__name__} computes per-parameter norms, which tensor-"
                "parallel shards would need summed over the tensor axis (not implemented). "
                "Fix: use an elementwise optimizer (Adam, AdamW, SGD, Lion) with tensor_parallel."
            )
        segments, groups, counts = [], [], []
        sharded = iter(zip(self.flat_groups, self.shard_axes))
        for has_shard in self._sharded_group_mask:  # one entry per optimizer param group
            if not has_shard:
                segments.append([])
                groups.append(None)
                counts.append(0)
                continue
            group, axis = next(sharded)
            index = {id(p): i for i, p in enumerate(group.params)}
            per_master: list[list[tuple[int, int, int]]] = [[] for _ in group.masters]
            for f in param_fragments(group):
                per_master[f.master_index].append((f.local, f.length, index[id(f.param)]))
            segments.append(per_master)
            groups.append(axis.group if self.stage >= 1 and axis.size > 1 else None)
            counts.append(len(group.params))
        opt.set_param_segments(segments, groups, counts)

    def _shard_axis(self, group: dict[str, Any]) -> ShardAxis:
        """The ranks a param group is sharded and reduced over: the data axis, or the
        ``expert_data`` axis of its experts (:mod:`shardspeed.runtime.expert_layout`)."""
        name = expert_name(group["params"])
        if name is not None:
            return expert_axis(name)
        topo, axis = self.topology, self._dense_axis()
        return ShardAxis(topo.group(axis), topo.size(axis), topo.rank_in(axis))

    def _dense_axis(self) -> str:
        """What dense parameters are sharded and reduced over: the data axis, and with
        sequence parallelism data x sequence (every sequence rank holds the whole model
        and the gradient of its own tokens; gradients are averaged over data ranks only)."""
        return "data_sequence" if self.topology.size("sequence") > 1 else "data"

    def _grad_reduction(self, axis: ShardAxis) -> GradReduction:
        """The communication seam: an optimizer that reduces by itself gets local grads.
        Every gradient is averaged over all data ranks (expert ones are summed over fewer)."""
        if getattr(self.basic_optimizer, "reduces_gradients", False):
            return LocalGradients()
        return BucketedReduction(axis.group, axis.size, average_over=self.dp_world_size)

    def _grad_norm(self, replicated: Sequence[nn.Parameter]) -> GradNorm:
        """Sum squared norms over every mesh axis whose ranks hold different gradient
        elements: data when gradients are sharded over it (at stage 0 every data rank
        holds the same reduced gradients), pipe (stages hold different layers); tensor-
        parallel shards also over the tensor axis (replicated parameters count once);
        expert groups over their expert axes. ``replicated`` parameters are counted by
        another rank (a pipeline's tied copies). Every rank builds the same terms."""
        topo = self.topology
        dense = self._dense_axis()
        # local gradients (a self-reducing optimizer): sum every rank's squares over the
        # data axis and divide by dp below, so all ranks clip and detect overflow alike
        local = getattr(self.basic_optimizer, "reduces_gradients", False)
        axes = [
            a for a in (dense, "pipe") if topo.size(a) > 1 and (a != dense or self.stage or local)
        ]
        default = [topo.group(a) for a in axes]
        skip = {id(p) for p in replicated}
        terms = [NormTerm(self._master_slices(lambda p: id(p) in skip), None)] if skip else []
        if topo.size("tensor") > 1:
            sharded = self._master_slices(lambda p: getattr(p, "tensor_model_parallel", False))
            terms.append(NormTerm(sharded, [*default, topo.group("tensor")]))
        pipe = [topo.group("pipe")] if topo.size("pipe") > 1 else []
        names = dict.fromkeys(n for g in self.flat_groups if (n := expert_name(g.params)))
        for name in names:
            slices = self._master_slices(lambda p, n=name: getattr(p, "group_name", None) == n)
            axes = expert_norm_groups(
                name, self.stage >= 1, self._config.moe.grad_norm,
                low_precision=self.precision.param_dtype != torch.float32,
                fused_adam=uses_fused_adam(self.basic_optimizer, self._config.optimizer),
            )  # fmt: skip
            terms.append(NormTerm(slices, [*axes, *pipe]))
        divide = float(topo.size(dense)) if local else 1.0
        return GradNorm(default, self.device, terms, divide=divide)

    def _master_slices(self, keep: Callable[[nn.Parameter], bool]) -> list[tuple[int, int, int]]:
        """``(index into all masters, lo, hi)`` of this rank's fragments of matching params."""
        out, base = [], 0
        for group in self.flat_groups:
            out += [
                (base + f.master_index, f.local, f.local + f.length)
                for f in param_fragments(group)
                if keep(f.param)
            ]
            base += len(group.masters)
        return out

    def _build_offload(self, optimizer: Any, numel: int) -> OffloadRuntime:
        """Optimizer (and, at stage 3, parameter) offload as the config asks: none/cpu/nvme."""
        return OffloadRuntime.from_config(
            self._config,
            has_optimizer=optimizer is not None or self._config.optimizer is not None,
            rank=self.global_rank,
            device=self.device,
            numel_per_rank=-(-numel // self.dp_world_size),
            param_dtype=self.precision.param_dtype,
            master_dtype=self.precision.master_dtype,
        )

    def _checks_overflow(self) -> bool:
        if self.precision.param_dtype == torch.float16:
            return True
        if self.precision.param_dtype == torch.bfloat16:
            return bool(getattr(self._config.bf16, "check_grad_overflow", True))
        return False

    def _takes_initial_zero_grad_step(self) -> bool:
        """Whether DeepSpeed 0.19.8 would step this optimizer once with zero gradients when
        built: its 16-bit ZeRO-0 wrappers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``,
        for client and config optimizers alike) do; its ZeRO optimizers, fp32 training and
        the bf16 pipeline optimizer (``BF16_Optimizer``) do not. Config
        ``initial_zero_grad_step: "none"`` turns it off."""
        if self._config.initial_zero_grad_step != "deepspeed" or self.stage != 0:
            return False
        dtype = self.precision.param_dtype
        if dtype == torch.bfloat16:
            return not isinstance(self.module, PipelineModule)
        return dtype == torch.float16

    def _initial_zero_grad_step(self) -> None:
        """DeepSpeed's ``initialize_optimizer_states`` (see :meth:`_takes_initial_zero_grad_step`)."""
        assert self.optimizer is not None
        self.optimizer.step_with_zero_grads()
        if self.global_rank == 0:
            info_once(
                f"ZeRO stage 0 with {self.precision.param_dtype} parameters: stepped the "
                "optimizer once with zero gradients at construction, as DeepSpeed 0.19.8 does "
                "(Adam's first real update is then about 0.74 lr; weight decay, if any, moved "
                'the masters once). Set "initial_zero_grad_step": "none" in the config to skip '
                "it.",
                __name__,
            )

    def _check_optimizer_supported(self, optimizer: torch.optim.Optimizer) -> None:
        from shardspeed.optim import is_elementwise

        if not is_elementwise(optimizer) and not hasattr(optimizer, "set_param_segments"):
            raise ValueError(
                f"optimizer {type(optimizer).__name__} is not elementwise (e.g. per-parameter "
                "norms) and has no set_param_segments() to learn where each parameter sits in "
                f"the engine's flat buckets (zero_optimization.stage={self.stage}). Use Adam, "
                "AdamW, SGD, Adagrad, Lion or LAMB, or train it with plain PyTorch."
            )

    def _build_lr_scheduler(self, lr_scheduler: Any) -> Any:
        if lr_scheduler is not None:
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                return lr_scheduler(self.basic_optimizer)
            return lr_scheduler
        if self._config.scheduler is not None and self.basic_optimizer is not None:
            from shardspeed.runtime.lr_schedules import build_lr_scheduler

            sched = self._config.scheduler
            return build_lr_scheduler(sched.type, dict(sched.params), self.basic_optimizer)
        return None

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
        if self.stage >= 2:
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
        """Reduce the locally accumulated gradients now, as on an accumulation boundary.

        ``bucket_size`` is accepted for DeepSpeed compatibility; buckets are laid out once
        from ``reduce_bucket_size``.
        """
        self.set_gradient_reduction(True)
        self._boundary_override = True
        self.reducer.flush()

    # -- queries ---------------------------------------------------------------------------
    def was_step_applied(self) -> bool:
        return self._last_step is not None and self._last_step.applied

    def get_global_grad_norm(self) -> float | None:
        return None if self._last_step is None else self._last_step.grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.basic_optimizer.param_groups] if self.basic_optimizer else []

    def get_mom(self) -> list[Any]:
        if not self.basic_optimizer:
            return []
        return [g.get("betas", (g.get("momentum"),))[0] for g in self.basic_optimizer.param_groups]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's ``generate`` (DeepSpeed passes it through to the module). With
        ``hybrid_engine.enabled`` ZeRO-3 weights are gathered once per call."""
        return self.module.generate(*args, **kwargs)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held on this rank by category: params, grads, master_params, optimizer_state, buffers."""
        return memory_breakdown(self)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The module's full state dict in its own names and layout (a collective call at
        stage 3 and with tensor parallelism: shards are gathered)."""
        if self.topology.size("tensor") > 1:
            from shardspeed.parallel.tensor.state import gather_full_state_dict
            from shardspeed.zero.init import GatheredParameters

            with GatheredParameters(list(self.module.parameters())):  # ZeRO-3: data axis
                return gather_full_state_dict(self.module)  # then the tensor axis
        return self.sharding.full_state_dict(self.module, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load a full state dict (every rank passes the same one; at stage 3 the shards and
        masters are updated too; with tensor parallelism each rank takes its slices; with
        expert parallelism each rank takes its experts from the ``ep_size=1`` model's dict
        that ``save_16bit_model`` writes, or a dict in its own local names as is)."""
        from shardspeed.checkpoint.expert_placement import ExpertNames

        state_dict = ExpertNames.of(self.module).local_state(state_dict)
        if self.topology.size("tensor") > 1:
            from shardspeed.parallel.tensor.state import load_full_state_dict
            from shardspeed.zero.init import GatheredParameters

            with GatheredParameters(list(self.module.parameters()), modifier_rank=0):
                result = load_full_state_dict(self.module, state_dict, strict=strict)
        else:
            result = self.sharding.load_full_state_dict(self.module, state_dict, strict)
        if self.stage < 3:  # stage 3 refreshes its masters when the gathered units exit
            self._masters_from_params()
        return result

    @torch.no_grad()
    def _masters_from_params(self) -> None:
        """Copy the (just loaded) whole parameters into this rank's master fragments, so the
        next step starts from them instead of the stale masters (bf16/fp16, offload)."""
        resident = getattr(self.optimizer, "state_resident", None)
        with resident(write=True) if resident is not None else contextlib.nullcontext():
            for group in self.flat_groups:
                if getattr(group, "masters_alias_params", False):
                    continue
                for f in param_fragments(group):
                    master = group.masters[f.master_index].view(-1)[f.local : f.local + f.length]
                    master.copy_(f.param.detach().reshape(-1)[f.start : f.start + f.length])

    @torch.no_grad()
    def publish_params(self) -> None:
        """Masters -> parameter shards -> usable parameters (after a checkpoint load)."""
        if self.optimizer is not None:
            self.optimizer._publish_params()  # respects NVMe-swapped masters
            return
        for group in self.flat_groups:
            group.copy_masters_to_params()
        self.sharding.publish()

    def train(self, mode: bool = True) -> ShardSpeedEngine:
        self.module.train(mode)
        self.training = mode
        return self

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """A dataloader of micro-batches over this rank's share of ``dataset``."""
        from shardspeed.runtime.dataloader import ShardSpeedDataLoader

        return ShardSpeedDataLoader(
            dataset,
            batch_size or self._config.train_micro_batch_size_per_gpu,
            dp_world_size=self.dp_world_size,
            dp_rank=self.dp_rank,
            shuffle=route == "train",
            drop_last=self._config.dataloader_drop_last,
            collate_fn=collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory,
            data_sampler=data_sampler,
        )

    @property
    def timers(self) -> Any:
        """Named phase timers (``forward``, ``backward``, ``backward_reduce``, ``step``)."""
        return self.reporter.timers

    @property
    def monitor(self) -> Any:
        return self.reporter.monitor

    # -- checkpoints (format and resharding live in shardspeed.checkpoint) -----------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        async_save: bool | None = None,
    ) -> bool:
        """Collective: every rank writes its own shards under ``save_dir/tag``.

        ``async_save`` (default: config ``checkpoint.async_save``) writes in the background.
        """
        from shardspeed.checkpoint.engine_api import save_checkpoint

        return save_checkpoint(
            self,
            save_dir,
            tag,
            client_state or {},
            save_latest,
            exclude_frozen_parameters,
            async_save=async_save,
        )

    def wait_checkpoint(self) -> None:
        """Wait for this rank's asynchronous save to be published; raise if it failed."""
        from shardspeed.checkpoint.engine_api import wait_checkpoint

        wait_checkpoint(self)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load (and reshard to this layout) a checkpoint; returns ``(path, client_state)``."""
        from shardspeed.checkpoint.engine_api import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """DeepSpeed's name (Accelerate's ZeRO-3 save): the full state dict as host tensors on
        rank 0 and {} elsewhere; a collective. With expert parallelism rank 0's dict holds
        every global expert (the ``ep_size=1`` model's names), as ``save_16bit_model``."""
        from shardspeed.checkpoint.model_export import export_state_dict

        state = export_state_dict(self, exclude_frozen_parameters)
        return state if state is not None else {}

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write the consolidated weights in the training dtype (rank 0 writes)."""
        from shardspeed.checkpoint.engine_api import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model

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
