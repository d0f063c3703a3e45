"""A corpus of hostile requests against one live server: no answer may be a 5xx, the
engine may not die, and afterwards ``/health`` is 200 and a greedy completion is the
same as before the corpus."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx

BASE = {"prompt": "fuzz me", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
GREEDY = {"prompt": "The same before and after", "max_tokens": 12, "temperature": 0}

HOSTILE_VALUES: list[object] = [
    None,
    True,
    0,
    -1,
    2**31,
    2**64,
    -(10**30),
    1e-300,
    1e-39,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "1",
    "\ud800",
    "\x00\u202e\ufeff",
    [],
    [1, "a"],
    {"a": {"b": []}},
    "x" * 3000,
]
COMPLETION_FIELDS = [
    "prompt",
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "echo",
    "best_of",
    "user",
]
CHAT_CASES: list[object] = [
    {"messages": None},
    {"messages": "hi"},
    {"messages": [{}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
    {"messages": [{"role": "user", "content": "a" * 90_000}]},
    {"messages": [{"role": "user", "content": "hi"}] * 2000},
    {"max_completion_tokens": 0},
    {"max_completion_tokens": 10**9},
    {"max_tokens": -5},
    {"tools": [{"type": "function"}]},
    {"logprobs": True},
    {"stream": True, "stream_options": {"include_usage": "yes"}},
    {"stream": True, "stream_options": None},
    {"repetition_penalty": 1e-300, "temperature": 1.0},
    {"temperature": 1.0, "top_p": 1e-300, "seed": 7},
    {"temperature": 2.0, "top_k": 1, "seed": -1},
]
RAW_BODIES: list[bytes] = [
    b"",
    b"{",
    b"}",
    b"[]",
    b"null",
    b"1",
    b'"prompt"',
    b"{'prompt': 'x'}",
    b'{"prompt": "x",}',
    b'{"prompt": "x"} trailing',
    b"\x00\x01\x02",
    b"\xff\xfe\xfd",
    b"\xef\xbb\xbf" + json.dumps(BASE).encode(),
    json.dumps(BASE).encode("utf-16"),
    b"[" * 40_000,
    b"{" * 40_000,
    b'{"a":' * 20_000,
    b'{"prompt": ' + b"[" * 30_000 + b"1" + b"]" * 30_000 + b"}",
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "\\udfff\\ud800", "max_tokens": 2}',
    b'{"prompt": "\\u0000", "max_tokens": 2}',
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "temperature": -Infinity}',
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "x", "max_tokens": 1e999}',
    b'{"prompt": "x", "prompt": 5}',
    b'{"\\ud800": 1, "prompt": "x"}',
    b'{"prompt": [[1, 2], [3]], "max_tokens": 2}',
    b'{"prompt": [[-1]], "max_tokens": 2}',
    b'{"prompt": [99999999999999999999], "max_tokens": 2}',
    b'{"prompt": [' + b"1," * 20_000 + b"1]}",
    b'{"prompt": "' + b"a" * 99_000 + b'"}',
    b'{"prompt": "x", "max_tokens": 2, "stop": ["' + b"s" * 1024 + b'"]}',
]
HEADER_CASES: list[dict[str, str]] = [
    {"content-type": "text/plain"},
    {"content-type": "application/x-www-form-urlencoded"},
    {"content-type": "multipart/form-data; boundary=zz"},
    {"content-type": "application/json; charset=utf-16"},
    {"content-type": ""},
    {"content-type": "application/json", "authorization": "Bearer \x7f"},
    {"content-type": "application/json", "content-encoding": "gzip"},
    {"content-type": "application/json", "expect": "100-continue"},
]
METHOD_PATHS: list[tuple[str, str]] = [
    ("GET", "/v1/completions"),
    ("PUT", "/v1/completions"),
    ("DELETE", "/v1/chat/completions"),
    ("PATCH", "/v1/models"),
    ("OPTIONS", "/v1/completions"),
    ("HEAD", "/health"),
    ("POST", "/health"),
    ("POST", "/metrics"),
    ("GET", "/v1/completions/"),
    ("GET", "/v1/models/tiny-gpt"),
    ("GET", "/v1/../../etc/passwd"),
    ("GET", "/%ff%fe"),
    ("GET", "/v1/" + "a" * 8000),
    ("GET", "/health?x=" + "%00" * 100),
    ("TRACE", "/health"),
    ("POST", "/v1/embeddings"),
]
RAW_HTTP: list[bytes] = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b'Content-Type: application/json\r\n\r\n5\r\n{"pro\r\n0\r\n\r\n',
    b"GET /health\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS ClientHello
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
    b"GET /health HTTP/1.0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\n\r\n{}",
]


def _requests() -> Iterator[tuple[str, str, bytes, dict[str, str]]]:
    """(method, path, body, headers) of every HTTP-level case of the corpus."""
    json_headers = {"content-type": "application/json"}
    for field in COMPLETION_FIELDS:
        for value in HOSTILE_VALUES:
            yield (
                "POST",
                "/v1/completions",
                json.dumps({**BASE, field: value}).encode(),
                json_headers,
            )
    for case in CHAT_CASES:
        body = json.dumps({**CHAT, **case}).encode()  # type: ignore[dict-item]
        yield "POST", "/v1/chat/completions", body, json_headers
    for path in ("/v1/completions", "/v1/chat/completions"):
        for raw in RAW_BODIES:
            yield "POST", path, raw, json_headers
        for headers in HEADER_CASES:
            yield "POST", path, json.dumps(BASE).encode(), headers
        yield "POST", path, json.dumps({}).encode(), json_headers
    for method, path in METHOD_PATHS:
        yield method, path, b"", {}


def _raw_status(port: int, payload: bytes) -> int | None:
    """The status a raw HTTP exchange got (None: the server closed without answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        try:
            while len(data) < 12:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return int(data[9:12]) if data.startswith(b"HTTP/1.") and len(data) >= 12 else None


async def _send_all(base: str, cases: list, concurrency: int = 8) -> list[tuple[int, str]]:
    """(status, text) of every case, ``concurrency`` requests in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def one(method: str, path: str, body: bytes, headers: dict) -> tuple[int, str]:
            async with gate:
                r = await client.request(method, path, content=body, headers=headers)
                return r.status_code, r.text

        return await asyncio.gather(*(one(*case) for case in cases))


def _greedy(client: httpx.Client) -> str:
    r = client.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_hostile_corpus_gets_no_5xx_and_the_engine_lives(server):
    thread, async_engine = server
    cases = list(_requests())
    assert len(cases) + len(RAW_HTTP) >= 300
    failures: list[str] = []
    statuses: dict[int | None, int] = {}
    with httpx.Client(base_url=thread.base_url, timeout=60) as client:
        before = _greedy(client)
        answers = asyncio.run(_send_all(thread.base_url, cases))
        for (method, path, body, _), (status, text) in zip(cases, answers):
            statuses[status] = statuses.get(status, 0) + 1
            if status >= 500:
                failures.append(f"{status} {method} {path} {body[:120]!r}: {text[:200]}")
        for payload in RAW_HTTP:
            status = _raw_status(thread.port, payload)
            statuses[status] = statuses.get(status, 0) + 1
            if status is not None and status >= 500:
                failures.append(f"{status} raw {payload[:80]!r}")
        assert not failures, f"{len(failures)} answers >= 500:\n" + "\n".join(failures[:20])
        assert async_engine.restarts == 0 and async_engine.is_healthy
        health = client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert _greedy(client) == before
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 200, statuses
    deadline = time.monotonic() + 10  # aborted streams drain from the engine
    while async_engine.queue_depth and time.monotonic() < deadline:
        time.sleep(0.05)
    assert async_engine.queue_depth == 0
