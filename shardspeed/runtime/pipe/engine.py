"""``PipelineEngine``: DeepSpeed's pipeline engine name over the one sharding engine.

A pipeline stage is an ordinary :class:`ShardSpeedEngine` over *this stage's* layers with
the topology's data-parallel group: ZeRO sharding (stages 0-3), mixed precision, loss
scaling, clipping and the LR schedule are the engine's own code. The pipeline itself is
a schedule that drives that engine, :class:`~.driver.PipelineDriver` (composition): the
executor runs the schedule's micro-batch actions and the driver answers the end-of-batch
ones (tied-gradient sum, the batch's one gradient reduction, the optimizer step) with the
engine's operations. This class is the DeepSpeed surface over both: construction checks
(``PipelineModule`` arguments against the config, ZeRO-3 residency), ``train_batch`` /
``eval_batch``, ``is_first_stage``/``is_last_stage``, data iterators, checkpoint hooks, and
clear errors for ``forward``/``backward``/``step``, which a pipeline does not have.

At ZeRO-3 the stage's layers are its units; they stay gathered for the whole batch or are
resharded after each pass (``pipeline.reshard_after_forward``, :mod:`~.zero_residency`).
DeepSpeed refuses ZeRO-2/3 with pipeline parallelism; here they need nothing beyond the
reduction being deferred to the end of the batch, which every stage already does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardspeed import comm
from shardspeed.accelerator import get_accelerator
from shardspeed.config import ShardSpeedConfig, load_config
from shardspeed.parallel.pipeline.schedule import ZERO_BUBBLE, check_schedule_args
from shardspeed.parallel.pipeline.tied import TiedWeights
from shardspeed.parallel.topology_cache import TOPOLOGIES
from shardspeed.runtime.engine import ShardSpeedEngine
from shardspeed.runtime.pipe.driver import PipelineDriver
from shardspeed.runtime.pipe.executor import ScheduleExecutor
from shardspeed.runtime.pipe.module import PipelineModule
from shardspeed.runtime.pipe.zero_residency import residency_cost
from shardspeed.topology import Topology
from shardspeed.utils.logging import get_logger, log_dist, warning_once

logger = get_logger(__name__)


class PipelineError(RuntimeError):
    """A call that a pipeline engine does not support (``forward``/``backward``/``step``)."""


def _ensure_groups(topology: Topology) -> None:
    try:
        topology.group("pipe")
    except RuntimeError:
        topology.create_groups()


def resolve_schedule(model: PipelineModule, config: ShardSpeedConfig) -> str:
    """The schedule to run: ``pipeline.schedule`` from the config when given, else the
    module's. The module placed its layers for its own schedule (one chunk per stage, or
    ``virtual_stages`` chunks), so the config may only pick a schedule of that placement."""
    chosen = config.pipeline.schedule
    if chosen is None or chosen == model.schedule:
        return model.schedule
    placement = getattr(model, "placement", None)
    if model.schedule != "1f1b" or model.virtual_stages != 1 or placement not in (None, "linear"):
        raise ValueError(
            f"pipeline.schedule={chosen!r} in the config disagrees with PipelineModule("
            f"schedule={model.schedule!r}, virtual_stages={model.virtual_stages}); set one of "
            "them (the module's argument decides where its layers go)."
        )
    return chosen


class PipelineEngine(ShardSpeedEngine):
    """Trains a :class:`PipelineModule` with ``train_batch`` (DeepSpeed's ``PipelineEngine``)."""

    def __init__(
        self,
        model: PipelineModule,
        config: ShardSpeedConfig,
        *,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
    ) -> None:
        if mpu is not None:
            raise ValueError(
                "initialize(mpu=...) cannot be combined with a PipelineModule: the module's "
                "topology defines the groups. Pass topology=PipeModelDataParallelTopology(...) "
                "to PipelineModule instead of an mpu."
            )
        topology = model.shard_topology
        _ensure_groups(topology)
        schedule_kind = resolve_schedule(model, config)
        check_schedule_args(
            schedule_kind, config.gradient_accumulation_steps, topology.pp, model.virtual_stages
        )
        if (
            schedule_kind in ZERO_BUBBLE
            and config.zero_optimization.stage == 3
            and config.pipeline.reshard_after_forward
        ):
            raise ValueError(
                f"schedule={schedule_kind!r} runs the weight-gradient (W) passes after the "
                "backward passes, when pipeline.reshard_after_forward=true has already "
                "released the stage's ZeRO-3 parameters; set pipeline.reshard_after_forward "
                "to false (the stage stays gathered for the batch) or use schedule='1f1b'."
            )
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"pipeline stage {topology.stage_id} holds no trainable parameters (layers "
                f"{model.stage_layer_indices()}); choose a partition_method that gives every "
                "stage a layer with parameters."
            )
        # ZeRO-3 gathers and releases each of the stage's layers as a unit (its layers are
        # attributes of the module, as a ModuleList's elements would be)
        model.zero3_unit_container = True
        # Tied copies must agree before the engine copies them into flat buffers/masters.
        model.to(get_accelerator().device(comm.get_local_rank()))
        ties = TiedWeights(model.tied_parameters(), model.tie_owners(), topology)
        ties.broadcast_weights()

        super().__init__(
            model,
            config,
            topology,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            replicated_params=model.replicated_parameters(),  # tied copies count once
        )
        self.stage_id = topology.stage_id
        self.num_stages = topology.pp
        self.micro_batches = config.gradient_accumulation_steps
        self.schedule_kind = schedule_kind
        self.virtual_stages = model.virtual_stages
        # ZeRO-3: the stage's units gathered once per batch, or per pass (zero_residency.py)
        self.keep_gathered = self.stage == 3 and not config.pipeline.reshard_after_forward
        self.residency = residency_cost(self.sharding) if self.stage == 3 else None
        if self.stage == 3:
            self.sharding.coordinator.reshard_after_forward = config.pipeline.reshard_after_forward
        # the schedule drives this engine (driver.py); this class is DeepSpeed's surface
        self.pipeline = PipelineDriver(
            self, model, ties, schedule_kind=schedule_kind, keep_gathered=self.keep_gathered
        )
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        log_dist(
            f"PipelineEngine: {self.num_stages} stages x dp {self.dp_world_size}, schedule "
            f"{self.schedule_kind} (virtual stages {self.virtual_stages}), "
            f"{self.micro_batches} micro-batches per batch, ZeRO stage {self.stage} "
            "(gradients reduced once per batch)"
        )
        if self.residency is not None:
            log_dist(self.residency.describe(config.pipeline.reshard_after_forward))
        elif "reshard_after_forward" in (config.raw.get("pipeline") or {}):
            warning_once(
                f"pipeline.reshard_after_forward has no effect at zero_optimization.stage="
                f"{self.stage}: only ZeRO-3 gathers parameters around use (stages 0-2 keep "
                "them whole)."
            )

    # -- DeepSpeed's pipeline surface ----------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch`` draws ``(inputs, labels)`` micro-batches from."""
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Apply ``fn`` to every item the data iterator yields."""
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """Renegotiate activation shapes on the next micro-batch (call on every rank)."""
        self.pipeline.link.reset_shapes()

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches.

        Returns the mean loss of the global batch (the same value on every stage).
        """
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.agg_train_loss = self.pipeline.train_batch(self.data_iterator, self.batch_fn)
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward ``num_micro_batches`` (default GAS) micro-batches without gradients.

        Returns the mean loss (``reduce_output='avg'``; broadcast to every stage when
        ``bcast_loss``) or, with ``reduce_output=None``, the per-micro-batch losses on the
        last stage. ``compute_loss=False`` returns the last stage's outputs per
        micro-batch instead. ``return_logits=True`` returns ``(result, outputs)`` with the
        last stage's per-micro-batch outputs (None on other stages).
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): allowed 'avg' or None.")
        was_training = self.module.training
        self.module.eval()
        try:
            result = self.pipeline.eval_batch(
                data_iter,
                self.batch_fn,
                num_micro_batches=num_micro_batches or self.micro_batches,
                compute_loss=compute_loss,
                keep_outputs=return_logits,
            )
        finally:
            self.module.train(was_training)
        outputs = result.outputs if self.is_last_stage() else None
        if not compute_loss:
            output: Any = outputs
        elif reduce_output is None:
            output = result.losses if self.is_last_stage() else None
        else:
            output = self.pipeline.aggregate_loss(result.losses, broadcast=bcast_loss)
        return (output, outputs) if return_logits else output

    # -- the driver's parts, under the names DeepSpeed scripts and tests use -----------------
    @property
    def link(self) -> Any:
        return self.pipeline.link

    @property
    def executor(self) -> ScheduleExecutor:
        return self.pipeline.executor

    @property
    def ties(self) -> TiedWeights:
        return self.pipeline.ties

    # -- checkpoint hook (see shardspeed.checkpoint.shards) ---------------------------------
    def checkpoint_replicated_params(self) -> list[torch.nn.Parameter]:
        """Tied copies owned by a lower stage: a checkpoint load fills them, a save skips them."""
        return self.module.replicated_parameters()

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load this stage's part of a state dict: the whole model's (``save_16bit_model``'s
        file, every layer under its global index) or this stage's own."""
        return super().load_state_dict(self.module.stage_state(state_dict), strict, assign)

    # -- calls that make no sense on a pipeline --------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            "PipelineEngine.forward() is not supported: the pipeline runs whole batches. Call "
            "engine.train_batch(data_iter) to train or engine.eval_batch(data_iter) to evaluate."
        )

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            "PipelineEngine.backward() is not supported: engine.train_batch(data_iter) runs "
            "forward, backward and the optimizer step for a whole batch."
        )

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError(
            "PipelineEngine.step() is not supported: engine.train_batch(data_iter) already "
            "takes the optimizer step at the end of each batch."
        )


def initialize_pipeline(
    model: PipelineModule,
    raw_config: Any,
    *,
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    training_data: Any = None,
    collate_fn: Any = None,
) -> tuple[PipelineEngine, Any, Any, Any]:
    """``shardspeed.initialize`` for a ``PipelineModule``: ``(engine, optimizer, loader, sched)``."""
    topology = model.shard_topology
    cfg = load_config(raw_config, dp_world_size=topology.dp)
    TOPOLOGIES.set_job(topology)  # deepspeed.utils.groups answers with the pipeline's mesh
    stages = cfg.pipeline.stages
    if stages != "auto" and stages != topology.pp:
        raise ValueError(
            f"pipeline.stages={stages} in the config disagrees with the PipelineModule's "
            f'{topology.pp} stages; set it to "auto" or {topology.pp}.'
        )
    engine = PipelineEngine(
        model,
        cfg,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
    )
    dataloader = None
    if training_data is not None:
        from shardspeed.runtime.dataloader import RepeatingLoader

        dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
        engine.training_dataloader = dataloader
        if engine.is_first_stage() or engine.is_last_stage():
            engine.set_dataiterator(iter(RepeatingLoader(dataloader)))
    return engine, engine.optimizer, dataloader, engine.lr_scheduler
