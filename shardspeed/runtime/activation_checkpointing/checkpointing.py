"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing.checkpointing``.

Re-exports :mod:`shardspeed.runtime.activation_checkpointing` (``checkpoint``,
``configure``, the RNG tracker, ...). DeepSpeed keeps its settings in module globals that
scripts read (``checkpointing.PARTITION_ACTIVATIONS``); here they are read-only views of
:func:`settings`, so they always show what :func:`configure` set.
"""

from __future__ import annotations

from typing import Any

from shardspeed.runtime.activation_checkpointing import (
    CheckpointFunction,
    CudaRNGStatesTracker,
    checkpoint,
    checkpoint_sequential,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
    settings,
)

# DeepSpeed's module-level flag -> the CheckpointSettings field it mirrors
_FLAGS = {
    "PARTITION_ACTIVATIONS": "partition_activations",
    "CPU_CHECKPOINT": "cpu_checkpointing",
    "CONTIGUOUS_CHECKPOINTING": "contiguous_checkpointing",
    "SYNCHRONIZE": "synchronize",
    "PROFILE_TIME": "profile",
    "num_layers": "num_checkpoints",
    "mpu": "mpu",
}


def __getattr__(name: str) -> Any:
    if name in _FLAGS:
        return getattr(settings(), _FLAGS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "checkpoint_sequential",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
    "settings",
    *_FLAGS,
]
