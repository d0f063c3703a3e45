"""FastGen pipeline parallelism: one engine's layers over this process and spawned stages.

``pipeline(model, pipeline_parallel=P)`` (or ``InferenceEngine.from_pretrained(...,
pipeline_parallel=P)``) builds stage 0 here and ``P - 1`` stage workers; the layer
split is in :mod:`.partition`, the stage models in :mod:`.stage_model`, the
in-flight schedule in :mod:`.engine`, the processes in :mod:`.stages` and
:mod:`.worker`.
"""

from shardspeed.inference.fastgen.pipeline_parallel.engine import (
    PIPELINE_SCHEDULES,
    PipelineInferenceEngine,
    check_pipeline_config,
)
from shardspeed.inference.fastgen.pipeline_parallel.errors import PipelineParallelError

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineInferenceEngine",
    "PipelineParallelError",
    "check_pipeline_config",
]
