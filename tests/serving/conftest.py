"""Fixtures for the serving tests: a tiny engine, a pipeline on a twin engine, live servers.

Every server binds 127.0.0.1 on a free port in a background thread and is stopped when
its fixture ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from serving_helpers import make_engine, start_server

from shardspeed.inference.serving.pipeline import Pipeline


@pytest.fixture(scope="module")
def pipe() -> Iterator[Pipeline]:
    p = Pipeline(make_engine())
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Any, Any]]:
    thread, async_engine = start_server(
        make_engine(), max_tokens_limit=64, max_request_bytes=100_000
    )
    yield thread, async_engine
    thread.stop()
