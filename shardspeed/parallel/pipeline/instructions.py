"""The instruction set of a pipeline schedule.

A schedule is data: for every stage, a list of *steps*, each a list of these frozen
instructions. The engine executes them one after another; tests and the simulator read
them without running a model.

Chunks: with ``virtual_stages > 1`` every rank holds that many model chunks; where
virtual stage ``k`` of ``num_stages * virtual_stages`` lives is the *placement*
(:func:`vstage_of`, :func:`locate_vstage`):

* ``"linear"`` (1F1B, interleaved 1F1B): stage ``k % num_stages``, chunk
  ``k // num_stages`` (the layer parts in order, round-robin over the stages);
* ``"v"`` (ZBV, DualPipeV; two chunks): stage ``s`` holds virtual stages ``s`` (chunk 0)
  and ``2p - 1 - s`` (chunk 1), so the model goes down the stages and comes back up:
  the first and the last virtual stage are on stage 0, and the hand-over from chunk 0
  to chunk 1 on the last stage is local (no transfer).

Without virtual stages ``chunk`` is always 0.

Backward: ``BackwardPass`` is the whole backward of a micro-batch. Zero-bubble schedules
split it (:mod:`~shardspeed.parallel.pipeline.weight_grad`) into ``BackwardInput`` (B:
the gradient of the chunk's input and of the non-Linear parameters) and
``BackwardWeight`` (W: the Linear layers' weight gradients, any time after B).

Communication instructions name the stage at the other end (``peer``) and the *local*
chunk they concern: ``SendActivation(mb, chunk)`` sends the output of local ``chunk``;
``RecvActivation(mb, chunk)`` receives the input of local ``chunk``; ``SendGrad`` sends
the gradient of a chunk's input; ``RecvGrad`` receives the gradient of a chunk's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

Placement = Literal["linear", "v"]


@dataclass(frozen=True)
class PipeInstruction:
    """Base class of every schedule instruction."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True, repr=False)
class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied weights over their tie group (first/last stage...)."""


@dataclass(frozen=True, repr=False)
class ReduceGrads(PipeInstruction):
    """Reduce this stage's gradients over the data-parallel group (once per batch)."""


@dataclass(frozen=True, repr=False)
class OptimizerStep(PipeInstruction):
    """Unscale, clip by the global norm, update, all-gather, step the LR schedule."""


@dataclass(frozen=True, repr=False)
class MicroBatchInstruction(PipeInstruction):
    """An instruction about one micro-batch on one local model chunk."""

    micro_batch: int
    chunk: int = 0


@dataclass(frozen=True, repr=False)
class LoadMicroBatch(MicroBatchInstruction):
    """Take the micro-batch from the data iterator (inputs on the first virtual stage,
    labels on the last)."""


@dataclass(frozen=True, repr=False)
class ForwardPass(MicroBatchInstruction):
    """Run the chunk's layers on the micro-batch (and the loss on the last virtual stage)."""


@dataclass(frozen=True, repr=False)
class BackwardPass(MicroBatchInstruction):
    """Back-propagate the micro-batch through the chunk."""


@dataclass(frozen=True, repr=False)
class BackwardInput(MicroBatchInstruction):
    """B: back-propagate to the chunk's input; the Linear weight gradients wait for W."""


@dataclass(frozen=True, repr=False)
class BackwardWeight(MicroBatchInstruction):
    """W: accumulate the Linear weight gradients that the chunk's B deferred."""


COMPUTE_INSTRUCTIONS = (ForwardPass, BackwardPass, BackwardInput, BackwardWeight)


@dataclass(frozen=True, repr=False)
class CommInstruction(MicroBatchInstruction):
    """A point-to-point transfer with pipeline stage ``peer``."""

    peer: int = 0
    is_send: ClassVar[bool] = False
    carries: ClassVar[str] = ""  # "activation" or "grad"


@dataclass(frozen=True, repr=False)
class SendActivation(CommInstruction):
    """Send the chunk's forward output to the next virtual stage."""

    is_send: ClassVar[bool] = True
    carries: ClassVar[str] = "activation"


@dataclass(frozen=True, repr=False)
class RecvActivation(CommInstruction):
    """Receive the chunk's forward input from the previous virtual stage."""

    is_send: ClassVar[bool] = False
    carries: ClassVar[str] = "activation"


@dataclass(frozen=True, repr=False)
class SendGrad(CommInstruction):
    """Send the gradient of the chunk's input to the previous virtual stage."""

    is_send: ClassVar[bool] = True
    carries: ClassVar[str] = "grad"


@dataclass(frozen=True, repr=False)
class RecvGrad(CommInstruction):
    """Receive the gradient of the chunk's output from the next virtual stage."""

    is_send: ClassVar[bool] = False
    carries: ClassVar[str] = "grad"


def vstage_of(stage_id: int, chunk: int, num_stages: int, placement: Placement = "linear") -> int:
    """The virtual stage that local ``chunk`` of ``stage_id`` runs (see the module docstring)."""
    if placement == "v":
        return stage_id if chunk == 0 else 2 * num_stages - 1 - stage_id
    return chunk * num_stages + stage_id


def locate_vstage(vstage: int, num_stages: int, placement: Placement = "linear") -> tuple[int, int]:
    """``(stage_id, chunk)`` holding virtual stage ``vstage``."""
    if placement == "v":
        return (vstage, 0) if vstage < num_stages else (2 * num_stages - 1 - vstage, 1)
    return vstage % num_stages, vstage // num_stages


def transfer_key(
    instr: CommInstruction, stage_id: int, num_stages: int, placement: Placement = "linear"
) -> tuple[str, int, int, int]:
    """What a transfer moves, identical on both ends: ``(carries, micro_batch, src_vstage, dst_vstage)``.

    ``stage_id`` is the stage executing ``instr``; its virtual stage is
    ``vstage_of(stage_id, instr.chunk, num_stages, placement)``.
    """
    vstage = vstage_of(stage_id, instr.chunk, num_stages, placement)
    if instr.carries == "activation":
        src, dst = (vstage, vstage + 1) if instr.is_send else (vstage - 1, vstage)
    else:
        src, dst = (vstage, vstage - 1) if instr.is_send else (vstage + 1, vstage)
    return (instr.carries, instr.micro_batch, src, dst)
