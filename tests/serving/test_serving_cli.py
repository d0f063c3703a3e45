"""`shardspeed serve DIR` in a subprocess: starts, answers, stops cleanly on SIGINT."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from shardspeed.inference.serving.client import Client
from shardspeed.models.gpt import GPT, GPTConfig


def test_serve_command_end_to_end(tmp_path):
    torch.manual_seed(0)
    GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=256)).save_pretrained(
        tmp_path / "tiny"
    )
    cmd = [
        sys.executable,
        "-m",
        "shardspeed.launcher",
        "serve",
        str(tmp_path / "tiny"),
        "--port",
        "0",
        "--api-key",
        "k",
        "--scheduler",
        "prefill_first",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "SHARDSPEED_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                match = re.search(r"serving on (http://127\.0\.0\.1:\d+)", lines.get(timeout=1))
            except queue.Empty:
                continue
            url = match.group(1) if match else None
        assert url is not None, "the server did not report its address"
        with Client(url, api_key="k") as client:
            assert client.models() == ["tiny"]
            body = client.complete("hello", max_tokens=4, temperature=0)
            assert body["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
