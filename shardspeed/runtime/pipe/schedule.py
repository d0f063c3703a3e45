"""DeepSpeed's ``deepspeed.runtime.pipe.schedule``: schedules and their instructions.

The schedules are :class:`~shardspeed.parallel.pipeline.schedule.PipeSchedule` values
(iterating one yields the list of instructions of each step, as DeepSpeed's do);
``TrainSchedule`` and ``InferenceSchedule`` build them with DeepSpeed's arguments.
"""

from __future__ import annotations

from shardspeed.parallel.pipeline.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from shardspeed.parallel.pipeline.schedule import (
    PipeSchedule,
    inference_schedule,
    one_f_one_b_schedule,
)


def TrainSchedule(micro_batches: int, stages: int, stage_id: int) -> PipeSchedule:
    """DeepSpeed's training schedule: 1F1B, then ``ReduceTiedGrads``, ``ReduceGrads``,
    ``OptimizerStep``."""
    return one_f_one_b_schedule(micro_batches, stages, stage_id)


def InferenceSchedule(micro_batches: int, stages: int, stage_id: int) -> PipeSchedule:
    """DeepSpeed's forward-only schedule (``eval_batch``)."""
    return inference_schedule(micro_batches, stages, stage_id)


__all__ = [
    "BackwardPass",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
]
