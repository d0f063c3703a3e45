"""``activation_checkpointing``: options read by ``shardspeed.checkpointing.configure``."""

from __future__ import annotations

from pydantic import Field, model_validator

from shardspeed.config.base import ConfigError, ConfigModel, Int, explain


class ActivationCheckpointingConfig(ConfigModel):
    """``activation_checkpointing``: how checkpointed activations are stored."""

    json_key = "activation_checkpointing"

    partition_activations: bool = Field(
        False, description="Shard checkpointed activations across model-parallel ranks."
    )
    cpu_checkpointing: bool = Field(
        False, description="Move (partitioned) checkpointed activations to CPU memory."
    )
    contiguous_memory_optimization: bool = Field(
        False,
        description="Copy checkpoints into one preallocated buffer (needs number_checkpoints).",
    )
    number_checkpoints: Int | None = Field(
        None, ge=1, description="Number of checkpointed layers (sizes the contiguous buffer)."
    )
    synchronize_checkpoint_boundary: bool = Field(
        False, description="Synchronize the device at each checkpoint boundary (debugging)."
    )
    profile: bool = Field(False, description="Time the checkpoint forward/recompute passes.")

    @model_validator(mode="after")
    def _check(self) -> ActivationCheckpointingConfig:
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ConfigError.at(
                "number_checkpoints",
                explain(
                    "is required when contiguous_memory_optimization is true",
                    None,
                    fix='add "number_checkpoints": <number of checkpointed layers>',
                ),
            )
        return self
