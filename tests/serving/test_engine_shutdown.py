"""``AsyncEngine.shutdown()`` shuts its engine down too (when the engine has ``shutdown``).

The real engine's ``shutdown`` releases its weight offload and tensor-parallel workers
and is idempotent; here a counting wrapper shows the call is made (and made safely a
second time), and an engine without ``shutdown`` is left alone. The tensor-parallel
case (workers exit at once) is in ``test_fastgen_tp.py``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from serving_helpers import make_engine

from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.serving.async_engine import AsyncEngine


class _CountingEngine:
    """Delegates to a real engine and counts ``shutdown`` calls."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.num_shutdowns = 0

    def shutdown(self) -> None:
        self.num_shutdowns += 1
        self._engine.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _NoShutdownEngine:
    """An engine-like object without ``shutdown`` (duck-typed engines need not have one)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "shutdown":
            raise AttributeError(name)
        return getattr(self._engine, name)


def _started(engine: Any) -> AsyncEngine:
    """A started AsyncEngine once its engine thread runs (``start`` does not wait)."""
    async_engine = AsyncEngine(engine).start()
    deadline = time.monotonic() + 10
    while not async_engine.is_healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert async_engine.is_healthy
    return async_engine


def _generate(async_engine: AsyncEngine, prompt: str) -> list[int]:
    async def run() -> list[int]:
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        outputs = [out async for out in async_engine.submit(prompt, params)]
        return outputs[-1].output_token_ids

    return asyncio.run(run())


def test_async_engine_shutdown_shuts_the_engine_down_once_per_call() -> None:
    engine = _CountingEngine(make_engine())
    async_engine = _started(engine)
    assert len(_generate(async_engine, "hi")) == 3
    async_engine.shutdown()
    assert engine.num_shutdowns == 1 and not async_engine.is_healthy
    with pytest.raises(RuntimeError, match="was shut down"):
        engine.add_request("again")
    async_engine.shutdown()  # idempotent: the engine's shutdown tolerates a second call
    assert engine.num_shutdowns == 2


def test_async_engine_shutdown_without_engine_shutdown() -> None:
    real = make_engine()
    async_engine = _started(_NoShutdownEngine(real))
    assert len(_generate(async_engine, "hi")) == 3
    async_engine.shutdown()  # nothing to call: no error
    assert not async_engine.is_healthy
    assert real.generate(["still usable"], SamplingParams(max_new_tokens=2))[0].output_token_ids
