"""``pipeline``: defaults for the pipeline-parallel engine."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from shardspeed.config.base import ConfigModel, Int, coerce_int, explain, is_auto


def _stages(value: Any) -> Any:
    if is_auto(value):
        return "auto"
    number = coerce_int(value)
    if isinstance(number, int) and not isinstance(number, bool) and number >= 1:
        return number
    raise ValueError(explain('expected a positive integer or "auto"', value))


class PipelineConfig(ConfigModel):
    """``pipeline``: pipeline-parallel schedule and partitioning options."""

    json_key = "pipeline"

    stages: Annotated[int | Literal["auto"], BeforeValidator(_stages)] = Field(
        "auto", description='Number of pipeline stages, or "auto" (taken from the module).'
    )
    partition: str = Field(
        "best",
        description='Layer partitioning method: "best", "parameters", "uniform" or "type:<regex>".',
    )
    seed_layers: bool = Field(False, description="Seed each layer's initialisation by its index.")
    activation_checkpoint_interval: Int = Field(
        0, ge=0, description="Checkpoint activations every N layers (0 = off)."
    )
    pipe_partitioned: bool = Field(
        True, description="Partition activations sent between stages over tensor-parallel ranks."
    )
    grad_partitioned: bool = Field(
        True, description="Partition gradients sent between stages over tensor-parallel ranks."
    )
    use_reentrant: bool = Field(
        True, description="Use reentrant activation checkpointing inside pipeline stages."
    )
    schedule: str | None = Field(
        None,
        description=(
            "Pipeline schedule by name (overrides PipelineModule(schedule=...) when that is "
            "left at its default); the layer placement it needs must match the module's."
        ),
    )
    reshard_after_forward: bool = Field(
        False,
        description=(
            "ZeRO-3 under pipeline parallelism: release a unit's gathered parameters after "
            "each forward/backward pass (True) instead of keeping the stage gathered for the "
            "whole batch (False: one all-gather per unit per batch)."
        ),
    )
