"""Fixtures of the robustness tier: live servers on the tiny engine of ``tests/serving``.

Every socket goes to 127.0.0.1; every test bounds its own waiting time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serving"))

from serving_helpers import make_engine, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, Any]]:
    """(ServerThread, AsyncEngine) on the tiny GPT, restarts after 0.2 s."""
    thread, async_engine = start_server(
        make_engine(), max_tokens_limit=64, max_request_bytes=100_000, restart_backoff_s=0.2
    )
    yield thread, async_engine
    thread.stop()
