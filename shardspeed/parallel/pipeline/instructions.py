"""The instruction set of a pipeline schedule.

A schedule is data: for every stage, a list of *steps*, each a list of these frozen
instructions. The engine executes them one after another; tests and the simulator read
them without running a model.

Chunks: with interleaved scheduling every rank holds ``virtual_stages`` model chunks.
Virtual stage ``k`` of ``num_stages * virtual_stages`` lives on stage ``k % num_stages``
as its chunk ``k // num_stages``. Without interleaving ``chunk`` is always 0.

Communication instructions name the stage at the other end (``peer``) and the *local*
chunk they concern: ``SendActivation(mb, chunk)`` sends the output of local ``chunk``;
``RecvActivation(mb, chunk)`` receives the input of local ``chunk``; ``SendGrad`` sends
the gradient of a chunk's input; ``RecvGrad`` receives the gradient of a chunk's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


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


def transfer_key(
    instr: CommInstruction, stage_id: int, num_stages: int
) -> tuple[str, int, int, int]:
    """What a transfer moves, identical on both ends: ``(carries, micro_batch, src_vstage, dst_vstage)``.

    ``stage_id`` is the stage executing ``instr``; virtual stage = ``chunk * num_stages + stage_id``.
    """
    vstage = instr.chunk * num_stages + stage_id
    if instr.carries == "activation":
        src, dst = (vstage, vstage + 1) if instr.is_send else (vstage - 1, vstage)
    else:
        src, dst = (vstage, vstage - 1) if instr.is_send else (vstage + 1, vstage)
    return (instr.carries, instr.micro_batch, src, dst)
