"""Shared helpers of the serving tests (engine factory, gated engine, live server)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.models.tokenizer import ByteTokenizer

MODEL_NAME = "tiny-gpt"
API_KEY = "test-secret"


def make_engine(**config: Any) -> InferenceEngine:
    """The real engine on a tiny random GPT (the same weights every call) + ByteTokenizer."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=256))
    return InferenceEngine.from_pretrained(model, tokenizer=ByteTokenizer(), device="cpu", **config)


class GatedEngine:
    """Wraps an engine so that ``step()`` waits until ``gate`` is set (to fill the queue)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.gate = threading.Event()

    def step(self) -> Any:
        self.gate.wait(timeout=30)
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def start_server(engine: Any, **settings: Any) -> tuple[Any, Any]:
    """(ServerThread, AsyncEngine) of a started server on 127.0.0.1 with a free port.

    ``settings`` are :class:`ServerSettings` fields plus ``max_queue``,
    ``restart_backoff_s`` (AsyncEngine) and ``limits`` (a ``ConnectionLimits``).
    """
    from shardspeed.inference.serving.app import ServerSettings, create_app
    from shardspeed.inference.serving.async_engine import AsyncEngine
    from shardspeed.inference.serving.server import ServerThread

    max_queue = settings.pop("max_queue", 256)
    restart_backoff_s = settings.pop("restart_backoff_s", 1.0)
    limits = settings.pop("limits", None)
    async_engine = AsyncEngine(engine, max_queue=max_queue, restart_backoff_s=restart_backoff_s)
    app = create_app(async_engine, ServerSettings(model_name=MODEL_NAME, **settings))
    thread = ServerThread(app, host="127.0.0.1", port=0, limits=limits)
    return thread.start(), async_engine
