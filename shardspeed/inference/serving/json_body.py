"""Read a request body as JSON without trusting it.

The checks, in order, each with the status it answers:

1. ``Content-Type`` is JSON (``application/json`` or ``application/*+json``) or absent: 415.
2. The size, from ``Content-Length`` and while reading: 413.
3. The whole body arrives within ``timeout_s`` of the handler starting: 408, and the
   connection is closed (a client that stalls mid-body holds no socket for long).
4. Arrays and objects nest at most :data:`MAX_JSON_DEPTH` deep, counted on the raw bytes
   before parsing, so 40,000 ``[`` cannot exhaust the parser's recursion: 400.
5. The body parses as JSON (``NaN``/``Infinity`` are not JSON): 400.
6. Every string is valid Unicode: ``"\\ud800"`` (a lone surrogate) is valid JSON but not
   text any tokenizer can encode: 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from starlette.requests import Request

from shardspeed.inference.serving.errors import APIError

MAX_JSON_DEPTH = 64

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only escapes can make surrogates


async def read_json_body(request: Request, max_bytes: int, timeout_s: float) -> Any:
    """The parsed JSON body of ``request``; raises :class:`APIError` as listed above."""
    check_content_type(request.headers.get("content-type"))
    body = await _read_body(request, max_bytes, timeout_s)
    return parse_json(body)


def check_content_type(value: str | None) -> None:
    """415 unless ``value`` is a JSON media type (an absent header is accepted)."""
    media = (value or "").split(";", 1)[0].strip().lower()
    if not media or media == "application/json":
        return
    if media.startswith("application/") and media.endswith("+json"):
        return
    raise APIError(
        415,
        f"Content-Type {value!r} is not supported: send a JSON body with "
        "'Content-Type: application/json'",
        code="unsupported_media_type",
    )


async def _read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    too_large = APIError(
        413,
        f"request body exceeds the server limit of {max_bytes} bytes",
        code="request_too_large",
        headers={"Connection": "close"},
    )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise too_large
        return bytes(body)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (the server's "
            "body_timeout); send it in one go",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


def json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep arrays/objects nest in ``body`` (brackets inside strings do not count);
    stops counting at ``limit + 1``."""
    depth = deepest = 0
    for char in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET):
        depth += 1 if char in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def parse_json(body: bytes) -> Any:
    """``json.loads`` with a depth limit, no ``NaN``/``Infinity`` and valid Unicode only."""
    if json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(
            400,
            f"malformed JSON body: arrays/objects nest deeper than {MAX_JSON_DEPTH} levels",
            code="invalid_json",
        )
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError, huge int literals
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from exc
    if _SURROGATE_ESCAPE.search(body):
        bad = first_invalid_text(data)
        if bad is not None:
            raise APIError(
                400,
                f"{bad}: contains a lone UTF-16 surrogate (such as \\ud800), which is not valid "
                "Unicode text; send valid UTF-8 text",
                param=bad,
                code="invalid_value",
            )
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON; send a finite number")


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def first_invalid_text(data: Any) -> str | None:
    """The path (``messages.0.content``) of the first string or key in ``data`` that is not
    valid Unicode, ``"body"`` for the top level, or None."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return _printable(path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                sub = f"{path}.{key}" if path else str(key)
                if not _is_text(str(key)):
                    return _printable(sub)
                stack.append((item, sub))
        elif isinstance(value, list):
            stack.extend(
                (item, f"{path}.{i}" if path else str(i))
                for i, item in enumerate(value)
                if isinstance(item, (str, list, dict))
            )
    return None


def _printable(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode("utf-8")
