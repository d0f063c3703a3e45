"""Engine checkpoints: atomic (optionally asynchronous), safetensors-only, resharded on load.

See ``docs/checkpoints.md`` for the format. Submodules (``shardspeed.checkpoint.utils``,
DeepSpeed's path of ``clone_tensors_for_torch_save``) load on first attribute access.
"""

from __future__ import annotations

from types import ModuleType

from shardspeed._submodules import load_submodule
from shardspeed.checkpoint.commit import CheckpointError
from shardspeed.checkpoint.consolidate import (
    convert_to_fp32_files,
    get_fp32_state_dict_from_checkpoint,
    iter_fp32_state_dict,
)
from shardspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from shardspeed.checkpoint.engine_api import (
    load_checkpoint,
    save_16bit_model,
    save_checkpoint,
    wait_checkpoint,
)
from shardspeed.checkpoint.integrity import CheckpointIntegrityError

__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "DeepSpeedCheckpoint",
    "convert_to_fp32_files",
    "get_fp32_state_dict_from_checkpoint",
    "iter_fp32_state_dict",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
    "wait_checkpoint",
]


def __getattr__(name: str) -> ModuleType:
    return load_submodule(__name__, name)
