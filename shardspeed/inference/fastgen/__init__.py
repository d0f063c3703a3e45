"""FastGen-style inference engine: blocked KV cache, continuous batching, Dynamic SplitFuse.

Names are imported lazily so that ``sampling_params``/``outputs`` stay cheap to import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "InferenceEngine": "engine",
    "EngineStats": "engine",
    "EngineConfig": "config",
    "SamplingParams": "sampling_params",
    "RequestOutput": "outputs",
    "RequestMetrics": "outputs",
    "register_model": "models.registry",
    "RaggedModel": "models.base",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    return getattr(module, name)
