"""``model_type`` -> ragged model class, filled by the ``@register_model`` decorator."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.models.base import RaggedModel

_REGISTRY: dict[str, type[RaggedModel]] = {}
_BUILTIN_FAMILIES = (
    "llama", "qwen3", "phi3", "gemma", "gemma2", "mixtral", "qwen_moe", "neox", "opt", "falcon",
    "gpt2", "shardspeed_gpt",
)  # fmt: skip


def register_model(*model_types: str) -> Callable[[type[RaggedModel]], type[RaggedModel]]:
    """Class decorator: serve HF configs whose ``model_type`` is one of ``model_types``."""

    def wrap(cls: type[RaggedModel]) -> type[RaggedModel]:
        for model_type in model_types:
            _REGISTRY[model_type] = cls
        return cls

    return wrap


def _load_builtin_families() -> None:
    for family in _BUILTIN_FAMILIES:
        importlib.import_module(f"shardspeed.inference.fastgen.models.{family}")


def supported_model_types() -> list[str]:
    _load_builtin_families()
    return sorted(_REGISTRY)


def get_model_class(model_type: str | None) -> type[RaggedModel]:
    """The registered class for ``model_type``; ``ValueError`` lists the supported ones."""
    _load_builtin_families()
    if model_type not in _REGISTRY:
        raise ValueError(
            f"config.json model_type={model_type!r} is not supported by the FastGen engine; "
            f"supported: {sorted(_REGISTRY)}. Register a new family with "
            "@register_model('<model_type>') on a RaggedModel subclass."
        )
    return _REGISTRY[model_type]
