"""Process-wide activation-checkpointing settings (``shardspeed.checkpointing.configure``).

DeepSpeed's checkpointing API is module-level (``configure`` once, then call
``checkpoint`` from model code), so the settings live in one small object here. Explicit
keyword arguments to :func:`configure` override the ds_config ``activation_checkpointing``
block, which overrides the defaults.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from shardspeed.utils.reset_hooks import register_reset_hook

# ds_config key -> attribute of CheckpointSettings
_CONFIG_KEYS = {
    "partition_activations": "partition_activations",
    "cpu_checkpointing": "cpu_checkpointing",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


@dataclass
class CheckpointSettings:
    """What :func:`checkpoint` does with the inputs it saves."""

    partition_activations: bool = False  # keep 1/MP of each saved input per model-parallel rank
    cpu_checkpointing: bool = False  # keep saved inputs in host memory
    contiguous_checkpointing: bool = False  # accepted for compatibility (see docs)
    num_checkpoints: int | None = None  # number of checkpointed layers (contiguous buffers)
    synchronize: bool = False  # synchronize the device at checkpoint boundaries
    profile: bool = False  # log the time of each checkpointed forward / recompute
    mpu: Any = None  # Megatron-style model-parallel unit, or None
    configured: bool = False


_SETTINGS = CheckpointSettings()


def settings() -> CheckpointSettings:
    """The current process-wide settings."""
    return _SETTINGS


def _block_from(deepspeed_config: Any) -> dict[str, Any]:
    """The ``activation_checkpointing`` block of a dict, a JSON path or a config object."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, (str, Path)):
        path = Path(deepspeed_config)
        if not path.is_file():
            raise ValueError(
                f"configure(deepspeed_config={str(deepspeed_config)!r}): no such file; "
                "pass a ds_config dict, a path to a JSON file, or a config object."
            )
        deepspeed_config = json.loads(path.read_text())
    if isinstance(deepspeed_config, dict):
        block = deepspeed_config.get("activation_checkpointing", {})
    else:
        block = getattr(deepspeed_config, "activation_checkpointing", None)
        if block is None:
            return {}
    if isinstance(block, dict):
        unknown = [k for k in block if k not in _CONFIG_KEYS]
        if unknown:
            hint = difflib.get_close_matches(unknown[0], list(_CONFIG_KEYS), n=1)
            raise ValueError(
                f"activation_checkpointing.{unknown[0]} is not a known key"
                + (f" (did you mean {hint[0]!r}?)" if hint else "")
                + f"; allowed keys: {sorted(_CONFIG_KEYS)}."
            )
        return dict(block)
    # pydantic model / dataclass / namespace with the ds_config field names
    return {key: getattr(block, key) for key in _CONFIG_KEYS if hasattr(block, key)}


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure activation checkpointing for this process.

    Args:
        mpu_: model-parallel unit with ``get_model_parallel_rank()``,
            ``get_model_parallel_world_size()`` and ``get_model_parallel_group()``, or None.
        deepspeed_config: ds_config dict, path to a ds_config JSON file, or an object with an
            ``activation_checkpointing`` attribute; its values are used unless overridden.
        partition_activations: each model-parallel rank keeps 1/MP of every saved input.
        contiguous_checkpointing: DeepSpeed's contiguous buffers (needs ``num_checkpoints``).
        num_checkpoints: number of checkpointed layers.
        checkpoint_in_cpu: keep saved inputs in host memory.
        synchronize: synchronize the device at the start and end of each checkpoint.
        profile: log the time spent in each checkpointed forward and recompute.
    """
    new = CheckpointSettings()
    for key, value in _block_from(deepspeed_config).items():
        if value is not None:
            setattr(new, _CONFIG_KEYS[key], value)
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    for name, value in overrides.items():
        if value is not None:
            setattr(new, name, value)
    if new.contiguous_checkpointing:
        if new.num_checkpoints is None:
            raise ValueError(
                "configure(contiguous_checkpointing=True) needs num_checkpoints (ds_config "
                "activation_checkpointing.number_checkpoints), got None; pass the number of "
                "checkpointed layers or turn contiguous checkpointing off."
            )
        if not new.partition_activations:
            raise ValueError(
                "configure(contiguous_checkpointing=True) requires partition_activations=True "
                "(ds_config activation_checkpointing.partition_activations); enable "
                "partitioning or turn contiguous checkpointing off."
            )
    if new.num_checkpoints is not None and new.num_checkpoints < 1:
        raise ValueError(
            f"configure(num_checkpoints={new.num_checkpoints}) must be a positive integer."
        )
    new.mpu = mpu_
    new.configured = True
    for f in fields(CheckpointSettings):
        setattr(_SETTINGS, f.name, getattr(new, f.name))


def is_configured() -> bool:
    """True once :func:`configure` has been called."""
    return _SETTINGS.configured


def set_num_layers(nlayers: int) -> None:
    """Record the number of checkpointed layers (DeepSpeed's ``num_checkpoints``)."""
    _SETTINGS.num_checkpoints = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn partitioning of saved inputs across model-parallel ranks on or off."""
    _SETTINGS.partition_activations = bool(partition_activation)


def model_parallel_rank() -> int:
    """Model-parallel (tensor-parallel) rank from the configured mpu, 0 without one."""
    mpu = _SETTINGS.mpu
    if mpu is None:
        return 0
    for name in ("get_model_parallel_rank", "get_tensor_model_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 0


def model_parallel_world_size() -> int:
    """Model-parallel world size from the configured mpu, 1 without one."""
    mpu = _SETTINGS.mpu
    if mpu is None:
        return 1
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def model_parallel_group() -> Any:
    """Model-parallel process group from the configured mpu (None = default group)."""
    mpu = _SETTINGS.mpu
    for name in ("get_model_parallel_group", "get_tensor_model_parallel_group"):
        if mpu is not None and hasattr(mpu, name):
            return getattr(mpu, name)()
    return None


@register_reset_hook
def _reset_settings() -> None:
    """Forget the configuration and the RNG streams (used between tests)."""
    from shardspeed.runtime.activation_checkpointing.rng import get_cuda_rng_tracker

    for f in fields(CheckpointSettings):
        setattr(_SETTINGS, f.name, getattr(CheckpointSettings(), f.name))
    get_cuda_rng_tracker().reset()
