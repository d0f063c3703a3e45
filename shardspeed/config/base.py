"""Shared pieces of every ds_config model: the base class, ``ConfigError`` and error text.

Every block of the ds_config is a :class:`ConfigModel`. The base class gives all of them the
same behaviour:

* unknown keys are rejected (``extra="forbid"``) with a "did you mean" hint;
* the literal value ``"auto"`` (Hugging Face style) is dropped, so the field takes its default;
* alternative key names (``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``) and
  deprecated ones are mapped to the canonical field, and a conflict between the two is an error;
* every failure is a :class:`ConfigError` whose lines name the JSON path, the value received,
  what is allowed and how to fix it.
"""

from __future__ import annotations

import contextvars
import difflib
import json
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from shardspeed.utils.logging import warning_once

AUTO = "auto"
_VALIDATING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardspeed_config_validating", default=False
)
_NOTHING = object()


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: where it is (dotted JSON path) and what to do about it."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<config>'}: {self.message}"


class ConfigError(ValueError):
    """A mistake in a ds_config. ``issues`` lists every problem found, one per line of text."""

    def __init__(self, message: str, issues: Sequence[ConfigIssue] = ()) -> None:
        super().__init__(message)
        self.issues: list[ConfigIssue] = list(issues)

    @classmethod
    def from_issues(
        cls, issues: Sequence[ConfigIssue], header: str = "Invalid ShardSpeed config"
    ) -> ConfigError:
        """Build one error listing every issue (one line each)."""
        lines = [str(issue) for issue in issues]
        if len(lines) == 1:
            message = f"{header}: {lines[0]}"
        else:
            message = f"{header} ({len(lines)} problems):\n" + "\n".join(f"  {x}" for x in lines)
        return cls(message, issues)

    @classmethod
    def at(cls, key: str, message: str) -> ConfigError:
        """An error about ``key`` relative to the block being validated.

        Raised inside validators; the converter prefixes the block's own JSON path, so the
        final message names the full path (``zero_optimization.offload_param.nvme_path``).
        """
        return cls(f"{key}: {message}", [ConfigIssue(key, message)])


def show(value: Any) -> str:
    """Render a received value the way the user wrote it (JSON), shortened if long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def explain(
    problem: str, got: Any = _NOTHING, allowed: str | None = None, fix: str | None = None
) -> str:
    """Compose the standard message: problem, value received, what is allowed, the fix."""
    text = problem
    if got is not _NOTHING:
        text += f" (got {show(got)})"
    if allowed:
        text += f". Allowed: {allowed}"
    if fix:
        text += f". Fix: {fix}"
    return text if text.endswith((".", "?")) else text + "."


def one_of(values: Iterable[Any]) -> str:
    """``"a", "b" or "c"`` for an allowed-values list."""
    items = [show(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def did_you_mean(key: str, candidates: Iterable[str]) -> str | None:
    """Closest candidate to a misspelt ``key`` (difflib), or None."""
    pool = sorted(set(candidates))
    match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    if not match:
        lowered = {c.lower(): c for c in pool}
        match = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
        match = [lowered[m] for m in match]
    return match[0] if match else None


def join_path(*parts: Any) -> str:
    """Join JSON path pieces: strings with dots, list indices as ``[i]``."""
    out = ""
    for part in parts:
        if part is None or part == "":
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


# ----------------------------------------------------------------------------------------------
# Lenient scalar types (5e8 for an int, "1e-3" for a float; booleans are not numbers)
# ----------------------------------------------------------------------------------------------


def coerce_int(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(explain("expected an integer, not a boolean", value, fix="use a number"))
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                return value
            if number.is_integer():
                return int(number)
    return value


def _coerce_float(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(explain("expected a number, not a boolean", value, fix="use a number"))
    return value


Int = Annotated[int, BeforeValidator(coerce_int)]
"""An ``int`` field that also accepts integral floats and strings such as ``5e8``."""

Float = Annotated[float, BeforeValidator(_coerce_float)]
"""A ``float`` field that rejects booleans (pydantic would read ``true`` as 1.0)."""


def lower_str(value: Any) -> Any:
    """Before-validator: lower-case strings (for case-insensitive enumerations)."""
    return value.strip().lower() if isinstance(value, str) else value


# ----------------------------------------------------------------------------------------------
# The base model
# ----------------------------------------------------------------------------------------------


def is_auto(value: Any) -> bool:
    """True for the Hugging Face placeholder ``"auto"``."""
    return isinstance(value, str) and value.strip().lower() == AUTO


class ConfigModel(BaseModel):
    """Base of every ds_config block (see the module docstring for the shared behaviour)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())

    json_key: ClassVar[str] = ""
    """Where this block lives in the ds_config (used in messages), e.g. ``zero_optimization``."""

    key_aliases: ClassVar[dict[str, str]] = {}
    """Alternative key -> canonical field name (both spellings are current; no warning)."""

    deprecated_keys: ClassVar[dict[str, str]] = {}
    """Deprecated key -> canonical field name (accepted with a warning)."""

    def __init__(self, /, **data: Any) -> None:
        if _VALIDATING.get():  # nested inside another block: the outermost call converts
            super().__init__(**data)
            return
        token = _VALIDATING.set(True)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error_from_validation(exc, type(self), type(self).json_key) from None
        finally:
            _VALIDATING.reset(token)

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Any:
        """Validate ``obj`` (a dict) into this block; errors become :class:`ConfigError`."""
        if _VALIDATING.get():
            return super().model_validate(obj, *args, **kwargs)
        token = _VALIDATING.set(True)
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise config_error_from_validation(exc, cls, cls.json_key) from None
        finally:
            _VALIDATING.reset(token)

    # -- key handling -------------------------------------------------------------------------

    @classmethod
    def known_keys(cls) -> set[str]:
        """Every key this block accepts (field names, aliases, deprecated names)."""
        keys = set(cls.model_fields)
        keys.update(f.alias for f in cls.model_fields.values() if f.alias)
        keys.update(cls.key_aliases)
        keys.update(cls.deprecated_keys)
        return keys

    @classmethod
    def canonical_key(cls, key: str) -> str | None:
        """Field name for a JSON key (or alias), or None if the key is unknown."""
        if key in cls.model_fields:
            return key
        for name, field in cls.model_fields.items():
            if field.alias == key:
                return name
        return cls.key_aliases.get(key) or cls.deprecated_keys.get(key)

    @model_validator(mode="before")
    @classmethod
    def _prepare_input(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if not is_auto(v)}
        data = cls._apply_key_aliases(data)
        return cls._preprocess(data)

    @classmethod
    def _apply_key_aliases(cls, data: dict[str, Any]) -> dict[str, Any]:
        for old, new in [*cls.key_aliases.items(), *cls.deprecated_keys.items()]:
            if old not in data:
                continue
            value = data.pop(old)
            if new in data and data[new] != value:
                raise ConfigError.at(
                    old,
                    explain(
                        f"conflicts with '{new}' (same setting, two values: "
                        f"{old}={show(value)}, {new}={show(data[new])})",
                        fix=f"keep only '{new}'",
                    ),
                )
            if old in cls.deprecated_keys:
                warning_once(
                    f"ds_config key '{join_path(cls.json_key, old)}' is deprecated; "
                    f"use '{join_path(cls.json_key, new)}' instead."
                )
            data.setdefault(new, value)
        return data

    @classmethod
    def _preprocess(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Hook for subclasses: adjust the raw dict (after "auto" dropping and aliasing)."""
        return data


# ----------------------------------------------------------------------------------------------
# pydantic ValidationError -> ConfigError
# ----------------------------------------------------------------------------------------------


def model_in(annotation: Any) -> type[ConfigModel] | None:
    """The ConfigModel class inside an annotation (``X | None``, ``Annotated[X, ...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, ConfigModel):
        return annotation
    origin = get_origin(annotation)
    if origin is Annotated or origin is Union or origin is types.UnionType:
        for arg in get_args(annotation):
            found = model_in(arg)
            if found is not None:
                return found
    return None


def _owner(root: type[ConfigModel], loc: tuple[Any, ...]) -> type[ConfigModel] | None:
    """The block class that owns the last element of ``loc`` (None if it cannot be told)."""
    cls: type[ConfigModel] | None = root
    for part in loc[:-1]:
        if cls is None or not isinstance(part, str):
            return None
        name = cls.canonical_key(part)
        if name is None:
            return None
        cls = model_in(cls.model_fields[name].annotation)
    return cls


def nested_home(owner: type[ConfigModel], key: str) -> str | None:
    """``block.key`` if ``key`` is a key of one of ``owner``'s sub-blocks (misplaced key)."""
    for name, field in owner.model_fields.items():
        sub = model_in(field.annotation)
        if sub is not None and sub is not owner and key in sub.known_keys():
            return f"{name}.{key}"
    return None


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "dict": "a JSON object",
    "model": "a JSON object",
    "list": "a JSON list",
}


def _pydantic_issue(err: dict[str, Any], root: type[ConfigModel], prefix: str) -> list[ConfigIssue]:
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    value = err.get("input", _NOTHING)
    ctx = err.get("ctx") or {}
    path = join_path(prefix, *loc)
    error = ctx.get("error")
    if isinstance(error, ConfigError):
        if error.issues:
            return [ConfigIssue(join_path(path, i.path), i.message) for i in error.issues]
        return [ConfigIssue(path, str(error))]

    owner = _owner(root, loc) if loc else None
    key = loc[-1] if loc else ""
    if kind == "extra_forbidden":
        candidates = owner.known_keys() if owner is not None else set()
        home = nested_home(owner, str(key)) if owner is not None else None
        guess = None if home is not None else did_you_mean(str(key), candidates)
        if home is not None:
            fix = (
                "this key belongs inside a block: did you mean "
                f"'{join_path(prefix, *loc[:-1], home)}'?"
            )
        elif guess is not None:
            fix = f"did you mean '{guess}'?"
        else:
            fix = "remove it or correct the spelling"
        allowed = ", ".join(sorted(candidates)) if candidates and not (guess or home) else None
        return [ConfigIssue(path, explain("unknown key", value, allowed, fix))]
    if kind == "missing":
        return [ConfigIssue(path, explain("required key is missing", fix="add it"))]

    message = str(err.get("msg", kind))
    for noise in ("Value error, ", "Assertion failed, "):
        if message.startswith(noise):
            message = message[len(noise) :]
    if kind in ("value_error", "assertion_error"):
        return [ConfigIssue(path, message)]  # our validators write complete messages
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "must be a JSON object"
    elif kind == "literal_error":
        message = "is not one of the allowed values"
    else:
        message = message[0].lower() + message[1:] if message else message
    default_text = ""
    if owner is not None and isinstance(key, str):
        name = owner.canonical_key(key)
        field = owner.model_fields.get(name) if name else None
        if field is not None and not field.is_required():
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = "{}"
            default_text = f" (default {show(default)})" if default != "{}" else ""
    allowed = None
    if kind == "literal_error" and "expected" in ctx:
        allowed = str(ctx["expected"])
    word = _TYPE_WORDS.get(kind.split("_")[0]) if "_" in kind else None
    if word and kind not in ("literal_error",):
        fix = f"use {word}, or remove the key to use the default{default_text}"
    elif allowed:
        fix = f"use one of the allowed values, or remove the key to use the default{default_text}"
    else:
        fix = f"correct the value, or remove the key to use the default{default_text}"
    return [ConfigIssue(path, explain(message, value, allowed, fix))]


def config_error_from_validation(
    exc: ValidationError, root: type[ConfigModel], prefix: str = ""
) -> ConfigError:
    """Convert a pydantic ``ValidationError`` into a ``ConfigError`` listing every problem."""
    issues: list[ConfigIssue] = []
    for err in exc.errors(include_url=False):
        for issue in _pydantic_issue(err, root, prefix):
            if issue not in issues:
                issues.append(issue)
    return ConfigError.from_issues(issues)
