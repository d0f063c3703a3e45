"""Runs one stage's instruction stream: micro-batch buffers, forward/backward, p2p.

State lives in dicts keyed by ``(micro_batch, chunk)`` and is dropped as soon as the
backward pass no longer needs it, so memory follows the schedule (1F1B keeps at most
``num_stages`` micro-batches of activations on stage 0, GPipe keeps all of them).
Instructions that are not about a micro-batch (``ReduceTiedGrads``, ``ReduceGrads``,
``OptimizerStep``) go to handlers supplied by the engine.

Zero-bubble schedules:

* ``BackwardInput`` (B) runs the backward with the stage's Linear weight gradients
  deferred under the micro-batch key, ``BackwardWeight`` (W) accumulates them
  (:class:`~shardspeed.parallel.pipeline.weight_grad.WeightGradSplit`, active for the
  run); a ``BackwardPass`` in the same run computes everything at once.
* V placement: a chunk whose neighbouring virtual stage is on this stage (the turn of
  the V) takes its input from that chunk's output (detached, like a received tensor)
  and hands its input gradient back locally. The loss is computed on the stage holding
  the last virtual stage (stage 0); before the end-of-batch handlers (or at the end of
  an inference run) its losses and kept outputs are relayed to the last stage, where
  the engine expects them.

``last_timing`` (:class:`StageTiming`) holds the wall time of the last ``run()``, the
part of it spent computing (F, B, W, BW) and the part spent in the end-of-batch
handlers, so ``1 - busy / (wall - handlers)`` is the measured bubble of this stage. The
times are host times; on an accelerator set ``sync_timing=True`` to synchronize the
device around every pass (slower, but the compute is then measured).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.parallel.pipeline.instructions import (
    BackwardInput,
    BackwardPass,
    BackwardWeight,
    ForwardPass,
    LoadMicroBatch,
    MicroBatchInstruction,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    locate_vstage,
)
from shardspeed.parallel.pipeline.p2p import PendingRecv, StageLink, as_tensor_tuple
from shardspeed.parallel.pipeline.schedule import PipeSchedule
from shardspeed.parallel.pipeline.weight_grad import WeightGradSplit
from shardspeed.runtime.pipe.module import PipelineModule

Key = tuple[int, int]  # (micro_batch, chunk)


@dataclass
class RunResult:
    """What one schedule produced on this stage (lists are empty off the last stage)."""

    losses: list[torch.Tensor] = field(default_factory=list)  # detached, per micro-batch
    outputs: list[Any] = field(default_factory=list)  # last-stage outputs, when kept


_PASS_NAMES = {ForwardPass: "F", BackwardPass: "BW", BackwardInput: "B", BackwardWeight: "W"}
_RELAY_CHUNK = -1  # StageLink channel key of the loss stage -> last stage relay


@dataclass
class StageTiming:
    """Wall time of one ``run()``, the seconds spent in each kind of pass, and in the
    engine's end-of-batch handlers (reductions, optimizer step)."""

    wall_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)  # "F", "B", "W", "BW"
    handlers_s: float = 0.0

    @property
    def busy(self) -> float:
        return sum(self.busy_s.values())

    @property
    def bubble(self) -> float:
        """Measured idle fraction of the stage's pipelined part:
        ``1 - busy / (wall - handlers)``."""
        pipelined = self.wall_s - self.handlers_s
        return 1.0 - self.busy / pipelined if pipelined > 0 else 0.0


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
        self.vstages = [module.vstage(c) for c in range(module.virtual_stages)]
        # The stage that computes the loss (stage 0 in the V placement)
        self.loss_stage = locate_vstage(self.last_vstage, self.num_stages, module.placement)[0]
        self.weight_split: WeightGradSplit | None = None  # built on the first B/W split
        self.params_resident = False  # ZeRO-3 stage gathered for the whole batch (W may run)
        self.sync_timing = False
        self.last_timing = StageTiming()
        self._dispatch: dict[type, Callable[[Any], None]] = {
            LoadMicroBatch: self._load,
            ForwardPass: self._forward,
            BackwardPass: self._backward,
            BackwardInput: self._backward_input,
            BackwardWeight: self._backward_weight,
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
        self._first_inputs: dict[int, Any] = {}  # loaded, for virtual stage 0
        self._labels: dict[int, Any] = {}  # loaded, for the last virtual stage
        self._inputs: dict[Key, Any] = {}
        self._outputs: dict[Key, Any] = {}
        self._pending_inputs: dict[Key, PendingRecv] = {}
        self._pending_grads: dict[Key, PendingRecv] = {}
        self._input_grads: dict[Key, list[torch.Tensor]] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self.result = RunResult()
        self._relayed = False
        handlers = handlers or {}
        self.last_timing = timing = StageTiming()
        start = time.perf_counter()
        with contextlib.ExitStack() as stack:
            if schedule.splits_backward:
                if self.weight_split is None:
                    self.weight_split = WeightGradSplit(
                        self.module, partitioned_ok=self.params_resident
                    )
                stack.enter_context(self.weight_split.active())
                stack.callback(self.weight_split.clear)
            try:
                for step in schedule:
                    for instr in step:
                        self._execute(instr, handlers, timing)
                self._relay_results()
                if schedule.splits_backward:
                    assert self.weight_split is not None and not self.weight_split.pending(), (
                        "a B/W split schedule left weight-gradient passes undone"
                    )
            finally:
                self.link.wait_sends()
                self._first_inputs.clear()
                self._labels.clear()
        timing.wall_s = time.perf_counter() - start
        return self.result

    def _execute(
        self, instr: PipeInstruction, handlers: dict[type, Callable[[], None]], timing: StageTiming
    ) -> None:
        kind = type(instr)
        if kind in _PASS_NAMES:
            self._sync()
            start = time.perf_counter()
            self._dispatch[kind](instr)
            self._sync()
            name = _PASS_NAMES[kind]
            timing.busy_s[name] = timing.busy_s.get(name, 0.0) + time.perf_counter() - start
        elif kind in self._dispatch:
            self._dispatch[kind](instr)
        elif kind in handlers:
            self._relay_results()  # the engine reads the losses on the last stage
            start = time.perf_counter()
            handlers[kind]()
            timing.handlers_s += time.perf_counter() - start
        else:
            raise AssertionError(f"no handler for pipeline instruction {instr}")

    def _sync(self) -> None:
        if self.sync_timing:
            get_accelerator().synchronize()

    def _relay_results(self) -> None:
        """Move the losses (and kept outputs) from the loss stage to the last stage, once
        per run; a no-op unless the loss is computed elsewhere (the V placement)."""
        last = self.num_stages - 1
        if self._relayed or self.loss_stage == last:
            return
        self._relayed = True
        if self.stage_id not in (self.loss_stage, last):
            return
        count = self._num_micro_batches
        if self.stage_id == self.loss_stage:
            if self._compute_loss:
                self.link.send_grads([torch.stack(self.result.losses)], last)
            for output in self.result.outputs:
                self.link.send_activation(output, _RELAY_CHUNK, last)
            self.result = RunResult()
            return
        if self._compute_loss:
            like = [torch.empty(count, dtype=torch.float32, device=self.device)]
            (losses,) = self.link.recv_grads(like, self.loss_stage).wait()
            self.result.losses = list(losses.unbind(0))
        if self._keep_outputs or not self._compute_loss:
            self.result.outputs = [
                self.link.recv_activation(_RELAY_CHUNK, self.loss_stage).wait()
                for _ in range(count)
            ]

    # -- data --------------------------------------------------------------------------
    def _vstage(self, chunk: int) -> int:
        return self.vstages[chunk]

    def _local_chunk(self, vstage: int) -> int | None:
        """This stage's chunk running ``vstage``, or None when another stage runs it."""
        return self.vstages.index(vstage) if vstage in self.vstages else None

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
        if 0 in self.vstages:
            self._first_inputs[mb] = batch[0]
        if self.last_vstage in self.vstages:
            self._labels[mb] = batch[1]

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
        previous = self._local_chunk(vstage - 1) if vstage > 0 else None
        if vstage == 0:
            inputs = self._to_device(self._first_inputs.pop(instr.micro_batch), cast=True)
            if isinstance(inputs, list):
                inputs = tuple(inputs)
            if self._train and self.module.activation_checkpoint_interval > 0:
                # A reentrant checkpoint only back-propagates into its layers when an input
                # requires grad (DeepSpeed does the same for the first stage's inputs).
                inputs = _float_inputs_require_grad(inputs)
        elif previous is not None:  # the turn of the V: the previous chunk is local
            produced = self._outputs[(instr.micro_batch, previous)]
            if not self._train:
                del self._outputs[(instr.micro_batch, previous)]
            inputs = _handover(produced)
        else:
            inputs = self._pending_inputs.pop(key).wait()
        outputs = self.module(inputs, chunk=instr.chunk)
        if self._train:
            self._inputs[key] = inputs
        if vstage != self.last_vstage:
            self._outputs[key] = outputs
            return
        labels = self._to_device(self._labels.pop(instr.micro_batch), cast=False)
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
        """BW: the whole backward (weight gradients included) of one micro-batch."""
        self._run_backward(instr)

    def _backward_input(self, instr: BackwardInput) -> None:
        """B: input gradients now; the Linear weight gradients wait for W."""
        assert self.weight_split is not None, "BackwardInput outside a B/W split schedule"
        with self.weight_split.deferring((instr.micro_batch, instr.chunk)):
            self._run_backward(instr)

    def _backward_weight(self, instr: BackwardWeight) -> None:
        """W: accumulate the weight gradients B deferred (fires the grad-ready hooks)."""
        assert self.weight_split is not None, "BackwardWeight outside a B/W split schedule"
        self.weight_split.apply((instr.micro_batch, instr.chunk))

    def _run_backward(self, instr: MicroBatchInstruction) -> None:
        key = (instr.micro_batch, instr.chunk)
        vstage = self._vstage(instr.chunk)
        if vstage == self.last_vstage:
            self.scale_loss(self._losses.pop(instr.micro_batch)).backward()
        else:
            outputs = as_tensor_tuple(self._outputs.pop(key), "a pipeline stage's output")
            following = self._local_chunk(vstage + 1)
            if following is not None:  # the turn of the V: the next chunk is local
                grads = self._input_grads.pop((instr.micro_batch, following))
            else:
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


def _handover(value: Any) -> Any:
    """A local chunk's output as the next chunk's input: detached (the chunks' graphs stay
    apart, as across a p2p link) and requiring grad where the output did."""
    tensors = as_tensor_tuple(value, "a pipeline stage's output")
    out = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
    return out if isinstance(value, tuple) else out[0]


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
