"""ShardSpeed inference: the FastGen-style engine, ``pipeline()``, the server, ``init_inference``.

Everything loads lazily, so ``import shardspeed.inference`` stays cheap::

    from shardspeed.inference import pipeline
    pipe = pipeline("path/to/model")
    print(pipe(["DeepSpeed is"], max_new_tokens=32)[0])
"""

from __future__ import annotations

import importlib
from typing import Any

from shardspeed._submodules import load_submodule

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
    # init_inference (DeepSpeed's v1 engine; its class lives at shardspeed.inference.engine)
    "init_inference": ("shardspeed.inference.init_engine", "init_inference"),
    "InferenceEngineV1": ("shardspeed.inference.engine", "InferenceEngine"),
    "DeepSpeedInferenceConfig": ("shardspeed.inference.config", "DeepSpeedInferenceConfig"),
}

__all__ = list(_LAZY_ATTRS)


def __getattr__(name: str) -> Any:
    if name not in _LAZY_ATTRS:  # a submodule (``deepspeed.inference.engine``) or an error
        return load_submodule(__name__, name)
    module_name, attr = _LAZY_ATTRS[name]
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
