"""Runs one stage's instruction stream: micro-batch buffers, forward/backward, p2p.

State lives in dicts keyed by ``(micro_batch, chunk)`` and is dropped as soon as the
backward pass no longer needs it, so memory follows the schedule (1F1B keeps at most
``num_stages`` micro-batches of activations on stage 0, GPipe keeps all of them).
Instructions that are not about a micro-batch (``ReduceTiedGrads``, ``ReduceGrads``,
``OptimizerStep``) go to handlers supplied by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspeed.parallel.pipeline.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from shardspeed.parallel.pipeline.p2p import PendingRecv, StageLink, as_tensor_tuple
from shardspeed.parallel.pipeline.schedule import PipeSchedule
from shardspeed.runtime.pipe.module import PipelineModule

Key = tuple[int, int]  # (micro_batch, chunk)


@dataclass
class RunResult:
    """What one schedule produced on this stage (lists are empty off the last stage)."""

    losses: list[torch.Tensor] = field(default_factory=list)  # detached, per micro-batch
    outputs: list[Any] = field(default_factory=list)  # last-stage outputs, when kept


class ScheduleExecutor:
    """Executes :class:`PipeSchedule` instructions for one stage's ``PipelineModule``."""

    def __init__(
        self,
        module: PipelineModule,
        link: StageLink,
        *,
        device: torch.device,
        input_dtype: torch.dtype,
        scale_loss: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.module = module
        self.link = link
        self.device = device
        self.input_dtype = input_dtype
        self.scale_loss = scale_loss
        self.stage_id = module.stage_id
        self.num_stages = module.num_stages
        self.last_vstage = module.num_virtual_stages - 1
        self._dispatch: dict[type, Callable[[Any], None]] = {
            LoadMicroBatch: self._load,
            ForwardPass: self._forward,
            BackwardPass: self._backward,
            SendActivation: self._send_activation,
            RecvActivation: self._recv_activation,
            SendGrad: self._send_grad,
            RecvGrad: self._recv_grad,
        }

    def run(
        self,
        schedule: PipeSchedule,
        data_iter: Iterator[Any] | None,
        *,
        handlers: dict[type, Callable[[], None]] | None = None,
        batch_fn: Callable[[Any], Any] | None = None,
        compute_loss: bool = True,
        keep_outputs: bool = False,
    ) -> RunResult:
        """Execute every step of ``schedule``; returns this stage's losses/outputs."""
        self._data_iter = data_iter
        self._num_micro_batches = schedule.num_micro_batches
        self._batch_fn = batch_fn
        self._train = schedule.train
        self._compute_loss = compute_loss
        self._keep_outputs = keep_outputs
        self._batches: dict[int, tuple[Any, Any]] = {}
        self._inputs: dict[Key, Any] = {}
        self._outputs: dict[Key, Any] = {}
        self._pending_inputs: dict[Key, PendingRecv] = {}
        self._pending_grads: dict[Key, PendingRecv] = {}
        self._input_grads: dict[Key, list[torch.Tensor]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self.result = RunResult()
        handlers = handlers or {}
        try:
            for step in schedule:
                for instr in step:
                    self._execute(instr, handlers)
        finally:
            self.link.wait_sends()
            self._batches.clear()
        return self.result

    def _execute(self, instr: PipeInstruction, handlers: dict[type, Callable[[], None]]) -> None:
        kind = type(instr)
        if kind in self._dispatch:
            self._dispatch[kind](instr)
        elif kind in handlers:
            handlers[kind]()
        else:
            raise AssertionError(f"no handler for pipeline instruction {instr}")

    # -- data --------------------------------------------------------------------------
    def _vstage(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def _load(self, instr: LoadMicroBatch) -> None:
        mb = instr.micro_batch
        if self._data_iter is None:
            raise RuntimeError(
                f"pipeline stage {self.stage_id} needs data but has no data iterator; pass "
                "data_iter= to train_batch/eval_batch or training_data= to initialize()."
            )
        try:
            batch = next(self._data_iter)
        except StopIteration:
            raise RuntimeError(
                f"the data iterator ran out at micro-batch {mb} of {self._num_micro_batches}; each train_batch/eval_batch consumes "
                "gradient_accumulation_steps (or num_micro_batches) items. Use a longer or "
                "repeating iterator (shardspeed.runtime.dataloader.RepeatingLoader)."
            ) from None
        if self._batch_fn is not None:
            batch = self._batch_fn(batch)
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise ValueError(
                "a pipeline data iterator must yield (inputs, labels) pairs; got "
                f"{type(batch).__name__}{'' if not hasattr(batch, '__len__') else f' of length {len(batch)}'}."
            )
        self._batches[mb] = (batch[0], batch[1])

    def _to_device(self, value: Any, cast: bool) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.to(self.device, non_blocking=True)
            if cast and value.is_floating_point():
                value = value.to(self.input_dtype)
            return value
        if isinstance(value, tuple | list):
            return type(value)(self._to_device(v, cast) for v in value)
        return value

    # -- compute -----------------------------------------------------------------------
    def _forward(self, instr: ForwardPass) -> None:
        key = (instr.micro_batch, instr.chunk)
        vstage = self._vstage(instr.chunk)
        # The first and the last virtual stage (one rank each, or both when p == 1) use the
        # loaded batch once, in this forward pass.
        batch = self._batches.pop(instr.micro_batch) if vstage in (0, self.last_vstage) else None
        if vstage == 0:
            inputs = self._to_device(batch[0], cast=True)
            if isinstance(inputs, list):
                inputs = tuple(inputs)
            if self._train and self.module.activation_checkpoint_interval > 0:
                # A reentrant checkpoint only back-propagates into its layers when an input
                # requires grad (DeepSpeed does the same for the first stage's inputs).
                inputs = _float_inputs_require_grad(inputs)
        else:
            inputs = self._pending_inputs.pop(key).wait()
        outputs = self.module(inputs, chunk=instr.chunk)
        if self._train:
            self._inputs[key] = inputs
        if vstage != self.last_vstage:
            self._outputs[key] = outputs
            return
        labels = self._to_device(batch[1], cast=False)
        if self._compute_loss:
            loss = outputs if self.module.loss_fn is None else self.module.loss_fn(outputs, labels)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(
                    "the pipeline loss must be a scalar tensor; loss_fn(outputs, labels) (or "
                    "the last layer when loss_fn is None) returned "
                    f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
                )
            self._losses[instr.micro_batch] = loss
            self.result.losses.append(loss.detach().float().reshape(()))
        if self._keep_outputs or not self._compute_loss:
            self.result.outputs.append(_detach(outputs))

    def _backward(self, instr: BackwardPass) -> None:
        key = (instr.micro_batch, instr.chunk)
        vstage = self._vstage(instr.chunk)
        if vstage == self.last_vstage:
            self.scale_loss(self._losses.pop(instr.micro_batch)).backward()
        else:
            outputs = as_tensor_tuple(self._outputs.pop(key), "a pipeline stage's output")
            grads = self._pending_grads.pop(key).wait()
            tensors = [t for t in outputs if t.requires_grad]
            if tensors:
                torch.autograd.backward(tensors, grad_tensors=grads)
        inputs = self._inputs.pop(key)
        if vstage > 0:
            self._input_grads[key] = [
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in as_tensor_tuple(inputs, "a pipeline stage's input")
                if t.requires_grad
            ]

    # -- communication -----------------------------------------------------------------
    def _send_activation(self, instr: SendActivation) -> None:
        key = (instr.micro_batch, instr.chunk)
        outputs = self._outputs[key] if self._train else self._outputs.pop(key)
        self.link.send_activation(outputs, instr.chunk, instr.peer)

    def _recv_activation(self, instr: RecvActivation) -> None:
        key = (instr.micro_batch, instr.chunk)
        self._pending_inputs[key] = self.link.recv_activation(instr.chunk, instr.peer)

    def _send_grad(self, instr: SendGrad) -> None:
        key = (instr.micro_batch, instr.chunk)
        self.link.send_grads(self._input_grads.pop(key), instr.peer)

    def _recv_grad(self, instr: RecvGrad) -> None:
        key = (instr.micro_batch, instr.chunk)
        outputs = as_tensor_tuple(self._outputs[key], "a pipeline stage's output")
        like = [t for t in outputs if t.requires_grad]
        self._pending_grads[key] = self.link.recv_grads(like, instr.peer)


def _float_inputs_require_grad(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_float_inputs_require_grad(v) for v in value)
    return value


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detach(v) for v in value)
    return value
