"""ShardSpeed inference: the FastGen-style engine, the ``pipeline()`` API and the server.

Everything loads lazily, so ``import shardspeed.inference`` stays cheap::

    from shardspeed.inference import pipeline
    pipe = pipeline("path/to/model")
    print(pipe(["DeepSpeed is"], max_new_tokens=32)[0])
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_ATTRS = {
    # name -> (module, attribute)
    "pipeline": ("shardspeed.inference.serving.pipeline", "pipeline"),
    "Pipeline": ("shardspeed.inference.serving.pipeline", "Pipeline"),
    "Response": ("shardspeed.inference.serving.pipeline", "Response"),
    "serve": ("shardspeed.inference.serving.server", "serve"),
    "Client": ("shardspeed.inference.serving.client", "Client"),
    "InferenceEngine": ("shardspeed.inference.fastgen.engine", "InferenceEngine"),
    "EngineConfig": ("shardspeed.inference.fastgen.engine", "EngineConfig"),
    "SamplingParams": ("shardspeed.inference.fastgen.sampling_params", "SamplingParams"),
    "RequestOutput": ("shardspeed.inference.fastgen.outputs", "RequestOutput"),
}

__all__ = list(_LAZY_ATTRS)


def __getattr__(name: str) -> Any:
    if name not in _LAZY_ATTRS:
        raise AttributeError(f"module 'shardspeed.inference' has no attribute {name!r}")
    module_name, attr = _LAZY_ATTRS[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
