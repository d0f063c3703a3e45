"""Small shared utilities (logging, accelerator helpers) and, as in ``deepspeed.utils``, the
``safe_get_*`` / ``safe_set_*`` accessors of a parameter's fp32 state
(:mod:`shardspeed.zero.tensor_fragment`, loaded on first use)."""

from __future__ import annotations

import importlib
from typing import Any

from shardspeed.utils.logging import get_logger, log_dist, logger

_FRAGMENT_API = (
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
)

__all__ = ["get_logger", "log_dist", "logger", *_FRAGMENT_API]


def __getattr__(name: str) -> Any:
    if name not in _FRAGMENT_API:
        raise AttributeError(f"module 'shardspeed.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module("shardspeed.zero.tensor_fragment"), name)
    globals()[name] = value
    return value
