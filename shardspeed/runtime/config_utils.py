"""DeepSpeed's ``deepspeed.runtime.config_utils``: the config helpers extensions import.

ShardSpeed's own ds_config blocks derive from :class:`shardspeed.config.base.ConfigModel`
(aliases, "did you mean", errors that name the JSON path). Code written against DeepSpeed
(custom ops, inference and compression configs in third-party packages) subclasses
:class:`DeepSpeedConfigModel` instead, whose deprecated fields are declared DeepSpeed's way::

    class MyConfig(DeepSpeedConfigModel):
        new_size: int = 0
        old_size: str = Field("0", json_schema_extra={
            "deprecated": True, "new_param": "new_size", "new_param_fn": int})

Setting ``old_size`` logs a warning and writes ``int(old_size)`` into ``new_size``
(``new_param`` may be a dotted path into a nested model); setting both is an error. As in
DeepSpeed, ``"auto"`` values are dropped unless ``strict=True``.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator, Mapping, Sequence
from functools import reduce
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_serializer

from shardspeed.config.base import is_auto
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


class DeepSpeedConfigModel(BaseModel):
    """A pydantic base for DeepSpeed-style configs with deprecated fields (module docstring).

    A field is deprecated when its ``json_schema_extra`` has ``deprecated: True``; optional
    keys: ``deprecated_msg`` (added to the warning), ``new_param`` (the replacing field,
    dotted for nested models), ``set_new_param`` (default true: copy the value over) and
    ``new_param_fn`` (converts the value first).
    """

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # Hugging Face's "auto" placeholders take the default
            data = {k: v for k, v in data.items() if k == "replace_method" or not is_auto(v)}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._apply_deprecated(name, extra)

    def _apply_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        if name not in self.model_fields_set:
            return
        new_param = str(extra.get("new_param", ""))
        message = str(extra.get("deprecated_msg", ""))
        logger.warning(
            f"Config parameter {name} is deprecated"
            + (f" use {new_param} instead" if new_param else "")
            + (f". {message}" if message else "")
        )
        if not new_param or not extra.get("set_new_param", True):
            return
        convert = extra.get("new_param_fn", lambda value: value)
        value = convert(getattr(self, name))
        *parents, leaf = new_param.split(".")
        owner = reduce(getattr, parents, self)
        if leaf in owner.model_fields_set:
            raise ValueError(
                f"{type(self).__name__}: '{name}' is deprecated and replaced by '{new_param}'; "
                f"both were given ({name}={getattr(self, name)!r}, {new_param}="
                f"{getattr(owner, leaf)!r}). Fix: keep only '{new_param}'."
            )
        setattr(owner, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def serialize_torch_dtype(dtype: torch.dtype) -> str:  # noqa: N805 - pydantic's form
        return str(dtype)


def get_config_default(config: type[BaseModel], field_name: str) -> Any:
    """The default of ``field_name`` in the pydantic model ``config``."""
    field = config.model_fields.get(field_name)
    if field is None or field.is_required():
        raise ValueError(
            f"get_config_default({config.__name__}, {field_name!r}): "
            + ("no such field" if field is None else "the field is required and has no default")
            + f"; fields with defaults: "
            f"{[n for n, f in config.model_fields.items() if not f.is_required()]}."
        )
    return field.get_default()


class pp_int(int):  # noqa: N801 - DeepSpeed's name
    """An int shown with thousands separators (or a given text) in generated docs."""

    custom_print_str: str | None

    def __new__(cls, val: Any, custom_print_str: str | None = None) -> pp_int:
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{self.real:,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """``json.dumps(..., cls=ScientificNotationEncoder)``: numbers above 1e3 in scientific
    notation (``1.000000e+04``), one key per line; everything else as usual."""

    def iterencode(self, o: Any, _one_shot: bool = False, level: int = 0) -> Iterator[str] | str:  # type: ignore[override]
        indent = self.indent if isinstance(self.indent, int) else 4
        inner = " " * (level + 1) * indent
        outer = " " * level * indent
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, int | float):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, Mapping):
            items = [f'\n{inner}"{k}": {self.iterencode(v, level=level + 1)}' for k, v in o.items()]
            return "{" + ", ".join(items) + f"\n{outer}" + "}"
        if isinstance(o, Sequence) and not isinstance(o, str):
            return f"[{', '.join(str(self.iterencode(v)) for v in o)}]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """A plain object whose ``repr`` is its attributes as indented JSON."""

    def repr(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(
    param_dict: Mapping[str, Any], param_name: str, param_default_value: Any
) -> Any:
    """``param_dict[param_name]``, or the default when the key is missing."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is missing."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is missing."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.load(..., object_pairs_hook=...)`` hook that refuses a key given twice."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    duplicates = [key for key, n in counts.items() if n > 1]
    if duplicates:
        raise ValueError(
            f"Duplicate keys in DeepSpeed config: {duplicates}; each key may appear once per "
            "block. Fix: remove the repeated entries."
        )
    return dict(ordered_pairs)


__all__ = [
    "DeepSpeedConfigModel",
    "DeepSpeedConfigObject",
    "ScientificNotationEncoder",
    "dict_raise_error_on_duplicate_keys",
    "get_config_default",
    "get_dict_param",
    "get_list_param",
    "get_scalar_param",
    "pp_int",
]
