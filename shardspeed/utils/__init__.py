"""Small shared utilities (logging, accelerator helpers) and, as in ``deepspeed.utils``, the
``safe_get_*`` / ``safe_set_*`` accessors of a parameter's fp32 state
(:mod:`shardspeed.zero.tensor_fragment`), ``RepeatingLoader``, ``set_z3_leaf_modules`` (by
class, name or name suffix) and friends (:mod:`shardspeed.runtime.zero.leaf_module`); all
loaded on first use. DeepSpeed's submodules ``utils.groups`` and ``utils.zero_to_fp32`` are
served from the layers that define them (:mod:`shardspeed.runtime.groups`,
:mod:`shardspeed.checkpoint.zero_to_fp32`; see :data:`shardspeed._submodules.MOVED_MODULES`)."""

from __future__ import annotations

import importlib
from typing import Any

from shardspeed._submodules import load_submodule
from shardspeed.utils.logging import get_logger, log_dist, logger

_FRAGMENT_API = (
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
)

# name -> module that defines it
_LAZY_NAMES = {
    **dict.fromkeys(_FRAGMENT_API, "shardspeed.zero.tensor_fragment"),
    "RepeatingLoader": "shardspeed.runtime.dataloader",
    **dict.fromkeys(
        (
            "get_z3_leaf_modules",
            "set_z3_leaf_module",
            "set_z3_leaf_modules",
            "set_z3_leaf_modules_by_name",
            "set_z3_leaf_modules_by_suffix",
            "unset_z3_leaf_modules",
            "z3_leaf_module",
            "z3_leaf_parameter",
        ),
        "shardspeed.runtime.zero.leaf_module",
    ),
}

__all__ = ["get_logger", "log_dist", "logger", *_LAZY_NAMES]


def __getattr__(name: str) -> Any:
    if name not in _LAZY_NAMES:
        return load_submodule(__name__, name)  # logging, groups, zero_to_fp32, ...
    value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    globals()[name] = value
    return value
