"""Slow and stalled clients: partial headers and partial bodies are closed within their
timeouts, and a thousand stalled sockets under a 1024 open-file limit do not keep
``/health`` from answering within a second."""

from __future__ import annotations

import os
import queue
import re
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from serving_helpers import make_engine, start_server

from shardspeed.inference.serving.connections import ConnectionLimits
from shardspeed.models.gpt import GPT, GPTConfig

TIMEOUT_S = 1.0  # the header and body timeouts of the in-process server
SLACK_S = 1.5  # scheduling slack on a loaded 2-core machine

PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"
PARTIAL_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n"
    b'{"prompt":'
)


@pytest.fixture(scope="module")
def slow_server() -> Iterator[tuple[Any, Any]]:
    limits = ConnectionLimits(header_timeout_s=TIMEOUT_S, keep_alive_timeout_s=TIMEOUT_S)
    thread, async_engine = start_server(make_engine(), body_timeout_s=TIMEOUT_S, limits=limits)
    yield thread, async_engine
    thread.stop()


def _open(port: int, payload: bytes, n: int) -> dict[socket.socket, float]:
    """``n`` connections that each sent ``payload``: {socket: time connected}."""
    socks = {}
    for _ in range(n):
        opened = time.monotonic()
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(payload)
        s.setblocking(False)
        socks[s] = opened
    return socks


def _wait_closed(socks: dict[socket.socket, float], timeout_s: float) -> tuple[dict, dict]:
    """Read every socket until the server closes it or until ``timeout_s`` + 3 slacks
    after the last one connected; returns ({socket: seconds open}, {socket: bytes})."""
    deadline = max(socks.values()) + timeout_s + 3 * SLACK_S
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    closed: dict[socket.socket, float] = {}
    data: dict[socket.socket, bytes] = {s: b"" for s in socks}
    try:
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                s = key.fileobj
                try:
                    chunk = s.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:  # reset counts as closed
                    chunk = b""
                if chunk:
                    data[s] += chunk
                else:
                    closed[s] = time.monotonic() - socks[s]
                    sel.unregister(s)
    finally:
        sel.close()
        for s in socks:
            s.close()
    return closed, data


def _health_latency(base: str) -> float:
    start = time.monotonic()
    r = httpx.get(base + "/health", timeout=10)
    assert r.status_code == 200, r.text
    return time.monotonic() - start


def test_partial_headers_are_closed_within_the_header_timeout(slow_server):
    thread, _ = slow_server
    socks = _open(thread.port, PARTIAL_HEAD, 100)
    assert _health_latency(thread.base_url) < 1.0
    closed, data = _wait_closed(socks, TIMEOUT_S)
    assert len(closed) == 100, f"{100 - len(closed)} of 100 connections were never closed"
    assert max(closed.values()) <= TIMEOUT_S + SLACK_S
    assert all(d.startswith(b"HTTP/1.1 408 ") for d in data.values())
    assert _health_latency(thread.base_url) < 1.0


def test_partial_bodies_get_408_and_are_closed(slow_server):
    thread, async_engine = slow_server
    socks = _open(thread.port, PARTIAL_BODY, 20)
    assert _health_latency(thread.base_url) < 1.0
    closed, data = _wait_closed(socks, TIMEOUT_S)
    assert len(closed) == 20, f"{20 - len(closed)} of 20 connections were never closed"
    assert max(closed.values()) <= TIMEOUT_S + SLACK_S
    for d in data.values():
        assert d.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in d
    assert async_engine.queue_depth == 0


def test_idle_connection_after_a_request_is_closed(slow_server):
    """A kept-alive connection that starts a second request head and stalls is closed
    too (uvicorn's keep-alive timer stops at the first byte; the header timer does not)."""
    thread, _ = slow_server
    s = socket.create_connection(("127.0.0.1", thread.port), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    sent = time.monotonic()
    s.sendall(b"GET /hea")
    s.setblocking(False)
    closed, _ = _wait_closed({s: sent}, TIMEOUT_S)
    assert closed and closed[s] <= TIMEOUT_S + SLACK_S


# ---- a thousand stalled sockets against a server limited to 1024 open files ------------

NUM_STALLED = 1200  # more than the server may open: the defect needed only ~1,000
SERVER_FD_LIMIT = 1024
HEADER_TIMEOUT_S = 5.0  # longer than the probing below: eviction, not timeouts, saves /health


def _limit_fds() -> None:  # runs in the server process before exec
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (SERVER_FD_LIMIT, hard))


@pytest.fixture
def fd_limited_server(tmp_path) -> Iterator[str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < SERVER_FD_LIMIT:
        pytest.skip(f"the hard open-file limit {hard} is below {SERVER_FD_LIMIT}")
    if soft != resource.RLIM_INFINITY and soft < NUM_STALLED + 200:
        pytest.skip(f"ulimit -n is {soft}; this test's client needs {NUM_STALLED + 200}")
    torch.manual_seed(0)
    GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=256)).save_pretrained(
        tmp_path / "tiny"
    )
    cmd = [sys.executable, "-m", "shardspeed.launcher", "serve", str(tmp_path / "tiny")]
    cmd += ["--port", "0", "--log-level", "warning", "--header-timeout", str(HEADER_TIMEOUT_S)]
    env = {**os.environ, "SHARDSPEED_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(
        cmd,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        preexec_fn=_limit_fds,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                match = re.search(r"serving on (http://127\.0\.0\.1:\d+)", lines.get(timeout=1))
            except queue.Empty:
                continue
            url = match.group(1) if match else None
        assert url is not None, "the server did not report its address"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_1000_stalled_sockets_do_not_slow_health(fd_limited_server):
    base = fd_limited_server
    assert _health_latency(base) < 1.0
    port = int(base.rsplit(":", 1)[1])
    start = time.monotonic()
    socks = _open(port, PARTIAL_HEAD, NUM_STALLED)
    time.sleep(1.0)  # let the server accept (and evict) them all
    latencies = [_health_latency(base) for _ in range(3)]
    # No stalled socket has timed out yet: what kept /health fast is the connection cap.
    assert time.monotonic() - start < HEADER_TIMEOUT_S, "probing took too long to be meaningful"
    assert max(latencies) < 1.0, latencies
    closed, _ = _wait_closed(socks, HEADER_TIMEOUT_S)
    assert len(closed) == NUM_STALLED, f"{NUM_STALLED - len(closed)} stalled sockets stayed open"
    assert max(closed.values()) <= HEADER_TIMEOUT_S + SLACK_S
    assert _health_latency(base) < 1.0
