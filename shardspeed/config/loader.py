"""``load_config``: turn a dict, a JSON file, a base64 string or a config into a config.

JSON files may contain ``//`` and ``/* */`` comments and trailing commas (a small tolerant
pre-processor; hjson is not a dependency). Duplicate keys are rejected, naming the key and
the lines it appears on. Syntax errors report line and column.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from shardspeed.config.base import ConfigError, ConfigIssue, is_auto, join_path
from shardspeed.config.batch import check_batch_given
from shardspeed.config.top import ShardSpeedConfig
from shardspeed.utils.logging import get_logger, info_once

logger = get_logger(__name__)

ConfigSource = dict | str | os.PathLike | ShardSpeedConfig


# ----------------------------------------------------------------------------------------------
# Tolerant JSON
# ----------------------------------------------------------------------------------------------


def strip_json_comments(text: str) -> str:
    """Blank out ``//`` and ``/* */`` comments and trailing commas outside strings.

    Removed characters become spaces (newlines are kept), so line/column numbers in later
    error messages still point into the original text.
    """
    out = list(text)
    i, n = 0, len(text)
    in_string = False
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_string = False
            i += 1
            continue
        if ch == '"':
            in_string = True
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end == -1 else end
            out[i:end] = " " * (end - i)
            i = end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end == -1 else end + 2
            out[i:end] = [c if c == "\n" else " " for c in text[i:end]]
            i = end
            continue
        i += 1
    return _strip_trailing_commas("".join(out))


def _strip_trailing_commas(text: str) -> str:
    out = list(text)
    in_string = False
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == ",":
            j = i + 1
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] in "}]":
                out[i] = " "
        i += 1
    return "".join(out)


def parse_json_text(text: str, source: str = "<string>") -> dict[str, Any]:
    """Parse ds_config JSON text (comments and trailing commas allowed) into a dict.

    Raises:
        ConfigError: on a syntax error (with line/column), duplicate keys (with lines), or a
            top level that is not a JSON object.
    """
    cleaned = strip_json_comments(text)
    duplicates: list[str] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen and key not in duplicates:
                duplicates.append(key)
            seen[key] = value
        return seen

    try:
        data = json.loads(cleaned, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        line_text = cleaned.splitlines()[exc.lineno - 1] if cleaned.splitlines() else ""
        pointer = " " * (exc.colno - 1) + "^"
        raise ConfigError(
            f"Invalid JSON in {source} at line {exc.lineno}, column {exc.colno}: {exc.msg}.\n"
            f"    {line_text}\n    {pointer}\n"
            "Fix: correct the syntax (ShardSpeed accepts JSON plus // and /* */ comments and "
            "trailing commas; unquoted keys and single quotes are not allowed)."
        ) from None
    if duplicates:
        where = []
        for key in duplicates:
            pattern = re.compile(r'"' + re.escape(key) + r'"\s*:')
            lines = [cleaned.count("\n", 0, m.start()) + 1 for m in pattern.finditer(cleaned)]
            where.append(f"'{key}' (lines {', '.join(map(str, lines))})")
        raise ConfigError(
            f"Duplicate keys in {source}: {'; '.join(where)}. "
            "Fix: keep one occurrence of each key (JSON would silently keep the last)."
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"The ds_config in {source} must be a JSON object ({{...}}), got "
            f"{type(data).__name__}. Fix: wrap the settings in braces."
        )
    return data


# ----------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------


def _decode_base64(text: str) -> str | None:
    compact = "".join(text.split())
    if not compact or len(compact) < 4:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    altchars = b"-_" if ("-" in compact or "_" in compact) else None
    try:
        decoded = base64.b64decode(padded, altchars=altchars, validate=True)
        return decoded.decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None


def read_config_source(source: str | os.PathLike) -> dict[str, Any]:
    """A path to a JSON file, a base64-encoded JSON string or JSON text -> dict."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a very long base64 string is not a valid path
        is_file = False
    if is_file:
        return parse_json_text(path.read_text(encoding="utf-8"), source=str(path))
    if text.lstrip().startswith("{"):
        return parse_json_text(text, source="<JSON string>")
    decoded = _decode_base64(text)
    if decoded is not None and decoded.lstrip().startswith("{"):
        return parse_json_text(decoded, source="<base64 config>")
    shown = text if len(text) <= 120 else text[:117] + "..."
    if path.exists():
        problem = f"{path} exists but is not a file"
    else:
        problem = f"no file at {path.resolve()}, and it is not base64-encoded JSON"
    raise ConfigError(
        "Expected a path to an existing JSON config file, a dict, base64-encoded JSON or a "
        f"ShardSpeedConfig. Received the string {shown!r}: {problem}. Fix: check the path "
        "(relative paths are resolved from the current directory "
        f"{Path.cwd()}) or pass the config as a dict."
    )


def _auto_paths(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict):
        found: list[str] = []
        for key, value in data.items():
            path = join_path(prefix, key)
            found.extend([path] if is_auto(value) else _auto_paths(value, path))
        return found
    return []


def load_config(
    source: ConfigSource,
    *,
    dp_world_size: int | None = None,
    sections: Collection[str] | None = None,
) -> ShardSpeedConfig:
    """Build a :class:`ShardSpeedConfig` from a dict, a path, base64/JSON text or a config.

    Args:
        source: a dict; a path to a JSON file (comments and trailing commas allowed); a
            base64-encoded JSON string; or an existing ``ShardSpeedConfig`` (returned as-is,
            or re-resolved when ``dp_world_size`` is given).
        dp_world_size: when given, the batch triple is resolved for this data-parallel size
            and the three batch fields are ints afterwards.
        sections: when given, only these top-level keys are read and validated, the rest
            left at their defaults: for callers that use a few sections of a config whose
            other values may still be unresolved (``zero.Init`` under the Hugging Face
            Trainer, which fills ``scheduler`` ``"auto"`` values only at ``train()``).

    Raises:
        ConfigError: for every mistake, naming the JSON path, the value, what is allowed and
            the fix.
    """
    if isinstance(source, ShardSpeedConfig):
        return source if dp_world_size is None else source.resolve_batch(dp_world_size)
    if isinstance(source, dict):
        data = source
    elif isinstance(source, str | os.PathLike):
        data = read_config_source(source)
    else:
        raise ConfigError.from_issues(
            [
                ConfigIssue(
                    "<config>",
                    f"unsupported config type {type(source).__name__}. Allowed: dict, path, "
                    "base64 string or ShardSpeedConfig. Fix: pass one of those",
                )
            ]
        )
    if sections is not None:
        data = {key: value for key, value in data.items() if key in sections}
    autos = _auto_paths(data)
    if autos:
        info_once("ds_config 'auto' values resolved to defaults: " + ", ".join(autos))
    config = ShardSpeedConfig.model_validate(data)
    if dp_world_size is not None:
        config = config.resolve_batch(dp_world_size)
    else:  # what can be checked without a world size
        check_batch_given(
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )
    logger.debug("Resolved ShardSpeed config: %s", config.model_dump_json())
    return config
