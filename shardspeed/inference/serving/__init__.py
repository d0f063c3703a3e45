"""Serving on the FastGen engine: ``pipeline()``, the OpenAI-compatible server, a client.

Submodules load lazily so that ``pipeline()`` does not import the HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_ATTRS = {
    "pipeline": "shardspeed.inference.serving.pipeline",
    "Pipeline": "shardspeed.inference.serving.pipeline",
    "Response": "shardspeed.inference.serving.pipeline",
    "AsyncEngine": "shardspeed.inference.serving.async_engine",
    "QueueFullError": "shardspeed.inference.serving.async_engine",
    "EngineDeadError": "shardspeed.inference.serving.async_engine",
    "RequestFailedError": "shardspeed.inference.serving.async_engine",
    "ConnectionLimits": "shardspeed.inference.serving.connections",
    "serve": "shardspeed.inference.serving.server",
    "build_app": "shardspeed.inference.serving.server",
    "ServerThread": "shardspeed.inference.serving.server",
    "create_app": "shardspeed.inference.serving.app",
    "ServerSettings": "shardspeed.inference.serving.app",
    "Client": "shardspeed.inference.serving.client",
    "APIStatusError": "shardspeed.inference.serving.client",
}

__all__ = list(_LAZY_ATTRS)


def __getattr__(name: str) -> Any:
    if name not in _LAZY_ATTRS:
        raise AttributeError(f"module 'shardspeed.inference.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
    globals()[name] = value
    return value
