"""ShardSpeed: DeepSpeed's API and config on one clean sharding engine built on PyTorch.

``import shardspeed as deepspeed`` is the intended drop-in. Heavy subpackages load lazily:
DeepSpeed's eagerly imported subpackages (``runtime``, ``checkpoint``, ``utils``, ``zero``,
...) are attributes all the same, imported on first access, so ``import shardspeed`` stays
cheap. The names scripts use are listed in ``tests/unit/deepspeed_api_names.txt``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("."))
__git_hash__ = "unknown"
__git_branch__ = "unknown"
version, git_hash, git_branch = __version__, __git_hash__, __git_branch__

_LAZY_ATTRS = {
    # name -> (module, attribute or None for the module itself)
    "initialize": ("shardspeed.runtime.initialize", "initialize"),
    "add_config_arguments": ("shardspeed.runtime.initialize", "add_config_arguments"),
    "init_distributed": ("shardspeed.comm", "init_distributed"),
    "get_accelerator": ("shardspeed.accelerator", "get_accelerator"),
    "log_dist": ("shardspeed.utils.logging", "log_dist"),
    "logger": ("shardspeed.utils.logging", "logger"),
    "comm": ("shardspeed.comm", None),
    "zero": ("shardspeed.zero", None),
    "checkpointing": ("shardspeed.runtime.activation_checkpointing", None),
    "pipe": ("shardspeed.pipe", None),
    "moe": ("shardspeed.moe", None),
    "ops": ("shardspeed.ops", None),
    "inference": ("shardspeed.inference", None),
    "profiling": ("shardspeed.profiling", None),
    "monitor": ("shardspeed.monitor", None),
    "utils": ("shardspeed.utils", None),
    "config": ("shardspeed.config", None),
    "Topology": ("shardspeed.topology", "Topology"),
    "tp_model_init": ("shardspeed.parallel.tensor.autotp", "tp_model_init"),
    "init_inference": ("shardspeed.inference.init_engine", "init_inference"),
    "InferenceEngine": ("shardspeed.inference.engine", "InferenceEngine"),  # DeepSpeed's v1
    "sequence": ("shardspeed.sequence", None),
    # DeepSpeed's top-level names and eagerly imported subpackages
    "DeepSpeedEngine": ("shardspeed.runtime.engine", "DeepSpeedEngine"),
    "PipelineEngine": ("shardspeed.runtime.pipe.engine", "PipelineEngine"),
    "PipelineModule": ("shardspeed.pipe", "PipelineModule"),
    "DeepSpeedConfig": ("shardspeed.runtime.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("shardspeed.runtime.config", "DeepSpeedConfigError"),
    "runtime": ("shardspeed.runtime", None),
    "checkpoint": ("shardspeed.checkpoint", None),
    "accelerator": ("shardspeed.accelerator", None),
    "launcher": ("shardspeed.launcher", None),
    "elasticity": ("shardspeed.elasticity", None),
    "compression": ("shardspeed.compression", None),
    "git_version_info": ("shardspeed.git_version_info", None),
}

__all__ = ["__version__", *_LAZY_ATTRS]


def __getattr__(name: str) -> Any:
    if name not in _LAZY_ATTRS:
        raise AttributeError(f"module 'shardspeed' has no attribute {name!r}")
    module_name, attr = _LAZY_ATTRS[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
