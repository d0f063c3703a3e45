"""DeepSpeed's ``deepspeed.runtime.zero`` import paths, for code ported with only the import
line changed. The implementation lives in :mod:`shardspeed.zero`; these modules re-export
what users import from here: ``config`` (``DeepSpeedZeroConfig``), ``partition_parameters``
(``Init``, ``GatheredParameters``, ``ZeroParamStatus``), the memory estimators in
``stage3`` / ``stage_1_and_2`` (and ``stage3.unwrap_model_for_generation``), ``tiling``
(``TiledLinear``). ``Init`` and friends are also names of this package, as in
DeepSpeed (``deepspeed.zero`` is ``deepspeed.runtime.zero`` there)."""

from __future__ import annotations

import importlib
from typing import Any

from shardspeed._submodules import load_submodule

_ZERO_API = (
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
)


def __getattr__(name: str) -> Any:
    if name in _ZERO_API:
        return getattr(importlib.import_module("shardspeed.zero"), name)
    return load_submodule(__name__, name)
