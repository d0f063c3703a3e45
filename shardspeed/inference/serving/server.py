"""``serve()``: run the OpenAI-compatible server (uvicorn) in the foreground or a thread.

::

    serve("path/to/model", port=8000)                     # blocks until Ctrl-C
    server = serve(model, port=0, block=False)            # background thread
    print(server.base_url); server.stop()
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from shardspeed.inference.serving.app import ServerSettings, create_app
from shardspeed.inference.serving.async_engine import AsyncEngine
from shardspeed.inference.serving.connections import (
    ACCEPT_BATCH,
    LISTEN_BACKLOG,
    ConnectionLimits,
    guarded_h11_protocol,
)
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


def default_model_name(model_or_path: Any) -> str:
    """The id ``/v1/models`` reports: the directory name for a path, else a class-based name."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return Path(model_or_path).name or str(model_or_path)
    return "shardspeed-model"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _uvicorn_server(config: Any) -> Any:
    """A uvicorn server that restores the kernel accept queue to LISTEN_BACKLOG after
    asyncio's ``listen(ACCEPT_BATCH)`` (see :mod:`.connections`)."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            for sock in sockets or []:
                sock.listen(LISTEN_BACKLOG)

    return _Server(config)


class ServerThread:
    """The uvicorn server of an ASGI app running in a daemon thread (tests, notebooks).

    ``port=0`` binds a free port; :attr:`port` and :attr:`base_url` tell which. The
    socket listens from construction on, so clients that connect before uvicorn starts
    wait in the backlog instead of being refused. ``limits`` bounds slow and idle
    clients (see :class:`~.connections.ConnectionLimits`).
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: ConnectionLimits | None = None,
    ) -> None:
        import uvicorn

        limits = limits or ConnectionLimits()
        self.host = host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(LISTEN_BACKLOG)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
            http=guarded_h11_protocol(limits),
            timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
            backlog=ACCEPT_BATCH,  # asyncio's accepts per wakeup (and a listen() we undo)
        )
        self._server = _uvicorn_server(config)
        self._thread = threading.Thread(target=self._run, name="shardspeed-http", daemon=True)
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # surfaced by start()
            self._error = exc

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start serving and wait until the server accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until SIGINT/SIGTERM (uvicorn handles the signals)."""
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        finally:
            self._sock.close()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit (this also shuts the engine down) and join the thread."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_app(
    model_or_path: Any,
    tokenizer: Any = None,
    api_key: str | None = None,
    max_queue: int = 256,
    max_tokens_limit: int = 4096,
    max_request_bytes: int = 1_000_000,
    model_name: str | None = None,
    chat_template: str | None = None,
    default_chat_max_tokens: int = 128,
    body_timeout_s: float = 30.0,
    embedding_model: Any = None,
    pooling: str = "auto",
    lora_modules: dict[str, str] | None = None,
    lora_root: str | None = None,
    **engine_config: Any,
) -> Any:
    """Load the engine and return the ASGI app :func:`serve` runs (arguments as there)."""
    from shardspeed.inference.fastgen.engine import InferenceEngine

    for name, value in (
        ("max_tokens_limit", max_tokens_limit),
        ("max_request_bytes", max_request_bytes),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"serve({name}={value!r}) is invalid: it must be an int >= 1.")
    if not isinstance(body_timeout_s, (int, float)) or not 0 < body_timeout_s < float("inf"):
        raise ValueError(
            f"serve(body_timeout_s={body_timeout_s!r}) is invalid: it must be seconds > 0."
        )
    if isinstance(model_or_path, InferenceEngine):
        if tokenizer is not None or engine_config:
            raise ValueError(
                "serve() got an InferenceEngine together with tokenizer/engine options; configure "
                "the engine when you build it, or pass a model instead."
            )
        engine = model_or_path
    else:
        if lora_modules:
            engine_config.setdefault("enable_lora", True)
        engine = InferenceEngine.from_pretrained(
            model_or_path, tokenizer=tokenizer, **engine_config
        )
    _load_lora_modules(engine, lora_modules or {})
    if engine.tokenizer is None:
        raise ValueError(
            "serve() needs a tokenizer to turn text into tokens; pass tokenizer=... (e.g. "
            "shardspeed.models.tokenizer.ByteTokenizer()) or a model directory that has one."
        )
    settings = ServerSettings(
        model_name=model_name or default_model_name(model_or_path),
        api_key=api_key,
        max_tokens_limit=max_tokens_limit,
        max_request_bytes=max_request_bytes,
        default_chat_max_tokens=default_chat_max_tokens,
        chat_template=chat_template,
        body_timeout_s=float(body_timeout_s),
        lora_root=lora_root,
    )
    embedder = None
    if embedding_model is not None:
        from shardspeed.inference.serving.embedder import Embedder

        if isinstance(embedding_model, Embedder):
            embedder = embedding_model
        else:
            embedder = Embedder(embedding_model, pooling=pooling)
    return create_app(AsyncEngine(engine, max_queue=max_queue), settings, embedder=embedder)


def _load_lora_modules(engine: Any, lora_modules: dict[str, str]) -> None:
    """Load the adapters a server starts with (``--lora-modules name=path``)."""
    if not lora_modules:
        return
    if getattr(engine, "lora", None) is None:
        raise ValueError(
            f"serve(lora_modules={sorted(lora_modules)}) needs an engine built with "
            "enable_lora=True."
        )
    for name, path in lora_modules.items():
        engine.lora.load(name, path)


def serve(
    model_or_path: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 256,
    max_tokens_limit: int = 4096,
    max_request_bytes: int = 1_000_000,
    model_name: str | None = None,
    tokenizer: Any = None,
    chat_template: str | None = None,
    block: bool = True,
    log_level: str = "info",
    header_timeout_s: float = 10.0,
    body_timeout_s: float = 30.0,
    keep_alive_timeout_s: float = 5.0,
    max_connections: int | None = None,
    embedding_model: Any = None,
    pooling: str = "auto",
    lora_modules: dict[str, str] | None = None,
    lora_root: str | None = None,
    **engine_config: Any,
) -> ServerThread | None:
    """Serve a model over an OpenAI-compatible HTTP API.

    Args:
        model_or_path: anything ``InferenceEngine.from_pretrained`` takes, or a built engine.
        host: interface to bind; loopback by default. Binding another address without an
            ``api_key`` logs a warning.
        port: TCP port (0 picks a free one; see the returned thread's ``port``).
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_queue: requests allowed to wait for their first token; more get HTTP 429.
        max_tokens_limit: largest ``max_tokens`` a request may ask for (400 above it).
        max_request_bytes: largest request body (413 above it).
        model_name: the id in ``/v1/models`` and the only ``model`` requests may name
            (404 otherwise); defaults to the directory name.
        tokenizer: overrides the model's tokenizer.
        chat_template: a Jinja chat template overriding the tokenizer's (HF tokenizers).
        block: run in the foreground until interrupted (True) or return a started
            :class:`ServerThread` (False).
        header_timeout_s: a client must send its request line and headers within this
            many seconds of connecting (408 and close otherwise).
        body_timeout_s: ... and then its whole body within this many seconds (408).
        keep_alive_timeout_s: idle keep-alive connections close after this many seconds.
        max_connections: open connections at most (None: the open-file limit less 512);
            beyond it the oldest idle connection is closed to admit a new one.
        embedding_model: enables ``/v1/embeddings``: an HF model directory, a transformers
            model (with its tokenizer in an :class:`~.embedder.Embedder`) or an ``Embedder``.
        pooling: the embedding pooling (``"mean"``, ``"cls"``, ``"last"``; ``"auto"``: the
            directory's sentence-transformers setting, else ``last`` for decoder models and
            ``cls`` for encoders).
        lora_modules: ``{name: adapter directory}`` PEFT LoRA adapters served from the start
            (requests pick one with ``"model": name``); turns ``enable_lora`` on.
        lora_root: directory under which ``POST /v1/load_lora_adapter`` may load adapters
            while the server runs (None: runtime loading refused).
        engine_config: :class:`EngineConfig` fields (``block_size``, ``scheduler``, ...).
    """
    if api_key is None and not _is_loopback(host):
        logger.warning(
            "serving on %s without an api_key: anyone who can reach this address can use the "
            "model; pass api_key=... (or --api-key) to require one",
            host,
        )
    limits = ConnectionLimits(header_timeout_s, keep_alive_timeout_s, max_connections)
    app = build_app(
        model_or_path,
        tokenizer=tokenizer,
        api_key=api_key,
        max_queue=max_queue,
        max_tokens_limit=max_tokens_limit,
        max_request_bytes=max_request_bytes,
        model_name=model_name,
        chat_template=chat_template,
        body_timeout_s=body_timeout_s,
        embedding_model=embedding_model,
        pooling=pooling,
        lora_modules=lora_modules,
        lora_root=lora_root,
        **engine_config,
    )
    server = ServerThread(app, host=host, port=port, log_level=log_level, limits=limits)
    if not block:
        return server.start()
    logger.info("serving on %s (OpenAI-compatible API under /v1)", server.base_url)
    server.serve_forever()
    return None
