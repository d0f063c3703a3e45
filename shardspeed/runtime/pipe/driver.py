"""The pipeline as a schedule that drives the one engine.

:class:`PipelineDriver` owns what a pipeline adds to a stage's
:class:`~shardspeed.runtime.engine.ShardSpeedEngine`: the p2p link to the neighbouring
stages, the :class:`~.executor.ScheduleExecutor`, the tied-weight groups and the ZeRO-3
residency of the stage. A batch is one schedule (:mod:`shardspeed.parallel.pipeline.schedule`):
the executor runs its micro-batch actions (forward, backward or backward-input and
backward-weight, send, receive) on the stage's module, and the driver answers the
end-of-batch actions with the engine's own operations, the same ones a non-pipelined
step uses:

* ``ReduceTiedGrads``: sum tied weights' gradients over their tie groups;
* ``ReduceGrads``: ``engine.allreduce_gradients()``, the one reduction of the batch
  (all-reduce at stages 0/1, reduce-scatter into gradient shards at stages 2/3);
* ``OptimizerStep``: the batch loss (mean over micro-batches and data ranks, broadcast
  from the last stage) and ``engine._take_optimizer_step``, whose gradient norm spans
  the pipe axis and counts tied copies once.

Between batches the engine's reducer stays off (``set_gradient_reduction(False)``), so a
micro-batch issues no gradient collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardspeed import comm
from shardspeed.parallel.pipeline.instructions import OptimizerStep, ReduceGrads, ReduceTiedGrads
from shardspeed.parallel.pipeline.p2p import StageLink
from shardspeed.parallel.pipeline.schedule import build_schedule
from shardspeed.parallel.pipeline.tied import TiedWeights
from shardspeed.runtime.pipe.executor import ScheduleExecutor
from shardspeed.runtime.pipe.module import PipelineModule
from shardspeed.runtime.pipe.zero_residency import batch_residency


class PipelineDriver:
    """Runs training and evaluation batches of one stage through its engine."""

    def __init__(
        self,
        engine: Any,  # the stage's ShardSpeedEngine
        module: PipelineModule,
        ties: TiedWeights,
        *,
        schedule_kind: str,
        keep_gathered: bool,
    ) -> None:
        topology = engine.topology
        self.engine = engine
        self.module = module
        self.ties = ties
        self.schedule_kind = schedule_kind
        self.keep_gathered = keep_gathered  # ZeRO-3: the stage gathered once per batch
        self.stage_id = topology.stage_id
        self.num_stages = topology.pp
        self.virtual_stages = module.virtual_stages
        self.micro_batches = engine._config.gradient_accumulation_steps
        self.pipe_group = topology.group("pipe")
        self.link = StageLink(
            [topology.stage_rank(s) for s in range(self.num_stages)],
            engine.device,
            dynamic_shape=module.dynamic_shape,
        )
        self.executor = ScheduleExecutor(
            module,
            self.link,
            device=engine.device,
            input_dtype=engine.precision.param_dtype,
            scale_loss=engine.scale,
        )
        self.executor.params_resident = keep_gathered
        self.batch_loss: torch.Tensor | None = None
        engine.set_gradient_reduction(False)  # reduce once per batch, in ReduceGrads

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # -- batches ---------------------------------------------------------------------------
    def train_batch(
        self, data_iter: Iterator[Any] | None, batch_fn: Callable[[Any], Any] | None
    ) -> torch.Tensor:
        """One optimizer step over the batch's micro-batches; the batch's mean loss."""
        engine = self.engine
        self.batch_loss = None
        schedule = build_schedule(
            self.schedule_kind,
            self.micro_batches,
            self.num_stages,
            self.stage_id,
            self.virtual_stages,
        )
        try:
            with batch_residency(engine.sharding, self.keep_gathered):
                self.executor.run(
                    schedule,
                    data_iter,
                    batch_fn=batch_fn,
                    handlers={
                        ReduceTiedGrads: self._reduce_tied_grads,
                        ReduceGrads: engine.allreduce_gradients,
                        OptimizerStep: self._optimizer_step,
                    },
                )
        finally:  # micro-batches of the next batch accumulate without reducing again
            engine.set_gradient_reduction(False)
            engine._boundary_override = None
        assert self.batch_loss is not None
        return self.batch_loss

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        batch_fn: Callable[[Any], Any] | None,
        *,
        num_micro_batches: int,
        compute_loss: bool,
        keep_outputs: bool,
    ) -> Any:
        """Forward-only schedule; the executor's result (losses/outputs on the last stage)."""
        schedule = build_schedule(
            self.schedule_kind,
            num_micro_batches,
            self.num_stages,
            self.stage_id,
            self.virtual_stages,
            train=False,
        )
        self.link.reset_shapes()  # eval may use other shapes than training
        try:
            with torch.no_grad():
                return self.executor.run(
                    schedule,
                    data_iter,
                    batch_fn=batch_fn,
                    compute_loss=compute_loss,
                    keep_outputs=keep_outputs,
                )
        finally:
            self.link.reset_shapes()

    # -- end-of-batch actions ----------------------------------------------------------------
    def _reduce_tied_grads(self) -> None:
        self.ties.reduce_grads(self.engine.flat_groups)

    def _optimizer_step(self) -> None:
        engine = self.engine
        self.batch_loss = self.aggregate_loss(self.executor.result.losses, broadcast=True)
        engine.reporter.record_loss(self.batch_loss)
        engine.micro_steps += self.micro_batches
        engine._take_optimizer_step({})

    def aggregate_loss(self, losses: list[torch.Tensor], broadcast: bool) -> torch.Tensor | None:
        """Mean over micro-batches and data-parallel ranks, from the last stage."""
        engine = self.engine
        if self.is_last_stage:
            loss = torch.stack(losses).mean().to(engine.device)
            if engine.dp_world_size > 1:
                comm.all_reduce(loss, group=engine.dp_group)
                loss /= engine.dp_world_size
        else:
            loss = torch.zeros((), dtype=torch.float32, device=engine.device)
        if self.num_stages > 1 and broadcast:
            src = engine.topology.stage_rank(self.num_stages - 1)
            comm.broadcast(loss, src=src, group=self.pipe_group)
        elif not self.is_last_stage:
            return None
        return loss
