"""Activation checkpointing (``shardspeed.checkpointing``, DeepSpeed's ``deepspeed.checkpointing``).

Typical use in model code::

    import shardspeed

    shardspeed.checkpointing.configure(mpu, deepspeed_config=ds_config)
    shardspeed.checkpointing.model_parallel_cuda_manual_seed(1234)
    ...
    hidden = shardspeed.checkpointing.checkpoint(layer, hidden, attention_mask)

See ``docs/activation_checkpointing.md``. DeepSpeed's module path
``...activation_checkpointing.checkpointing`` (with its module-level flags) is the submodule
:mod:`.checkpointing`, loaded on first attribute access; so is :mod:`.offload_activations`
(``CheckpointHiddenStatesOffload``, host offload of Hugging Face checkpoint-layer inputs).
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule
from shardspeed.runtime.activation_checkpointing.checkpoint import (
    CheckpointFunction,
    checkpoint,
    checkpoint_sequential,
    non_reentrant_checkpoint,
)
from shardspeed.runtime.activation_checkpointing.config import (
    CheckpointSettings,
    configure,
    is_configured,
    partition_activations_in_checkpoint,
    set_num_layers,
    settings,
)
from shardspeed.runtime.activation_checkpointing.rng import (
    CudaRNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)


def reset() -> None:
    """Release buffers kept between forward passes (DeepSpeed's contiguous buffers).

    Nothing is pooled across calls here (saved inputs are ordinary tensors freed by
    autograd), so this only exists for API compatibility; configuration is kept.
    """


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)


__all__ = [
    "CheckpointFunction",
    "CheckpointSettings",
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
]
