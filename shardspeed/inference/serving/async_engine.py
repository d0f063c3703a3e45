"""One background thread owns the (not thread-safe) engine; asyncio code talks to it.

::

    async_engine = AsyncEngine(engine, max_queue=256).start()
    stream = async_engine.submit("Hello", params)     # raises QueueFullError when full
    try:
        async for out in stream:                       # RequestOutput snapshots
            ...
    finally:
        stream.abort()                                  # no-op once finished

The engine thread loops: apply queued add/abort commands, run one ``engine.step()``,
hand each output to its request's asyncio queue with ``loop.call_soon_threadsafe``.
It sleeps on the command queue while the engine is idle.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shardspeed.inference.serving.metrics import EngineGauges, ServingMetrics
from shardspeed.inference.serving.pipeline import request_timings
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.outputs import RequestOutput
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

logger = get_logger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting for their first token (the server answers 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped or its step raised; no request can be served."""


class RequestStream:
    """Async iterator over one request's :class:`RequestOutput` snapshots.

    Snapshots that pile up while the consumer is busy are merged: the consumer gets
    the latest one, with ``new_token_ids`` covering everything since its last read.
    Iteration ends after the snapshot with ``finished=True``.
    """

    def __init__(
        self, request_id: str, owner: AsyncEngine, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def _put(self, item: Any) -> None:  # runs in the event loop
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._queue.put_nowait(nxt)  # deliver the error on the next read
                break
            item = replace(nxt, new_token_ids=[*item.new_token_ids, *nxt.new_token_ids])
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Stop generating for this request (no-op once it has finished)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine.step()`` in a background thread and serves asyncio consumers.

    ``max_queue`` bounds the requests that were accepted but have no output yet
    (waiting for a slot or still in prefill); :meth:`submit` raises
    :class:`QueueFullError` beyond it.
    """

    def __init__(
        self, engine: Any, max_queue: int = 256, metrics: ServingMetrics | None = None
    ) -> None:
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} is invalid: it must be an int >= 1.")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._pending: set[str] = set()  # accepted, no output yet
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="shardspeed-engine", daemon=True)

    # ---- asyncio side -------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        """Start the engine thread (idempotent); returns self."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        return self

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread runs and no step has failed."""
        return self._thread.is_alive() and self._error is None and not self._stop.is_set()

    @property
    def queue_depth(self) -> int:
        """Requests accepted that have not produced an output yet."""
        with self._lock:
            return len(self._pending)

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request; must be called from a running event loop.

        Raises :class:`QueueFullError` when ``max_queue`` requests are already waiting,
        :class:`EngineDeadError` when the engine cannot serve. Errors the engine raises
        while adding the request (e.g. a prompt that is too long) come out of the
        stream's first read.
        """
        if not self.is_healthy:
            raise EngineDeadError(
                f"the inference engine is not running ({self._error or 'stopped'})"
            )
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        stream = RequestStream(request_id, self, loop)
        with self._lock:
            if len(self._pending) >= self.max_queue:
                self.metrics.record_rejected()
                raise QueueFullError(
                    f"the server queue is full ({self.max_queue} requests waiting); retry later "
                    "or start the server with a larger max_queue"
                )
            if request_id in self._streams:
                raise ValueError(f"request_id={request_id!r} is already in use; pass a unique id.")
            self._pending.add(request_id)
            self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt, params))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` (safe from any thread): it leaves the queue at once and the
        engine thread drops it before its next step."""
        self._forget(request_id)
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests fail with :class:`EngineDeadError`."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished())
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug or an OOM: fail every request, stay dead
                    logger.exception("engine.step() failed; failing all in-flight requests")
                    self._error = exc
                    break
                self._dispatch(outputs)
                self._refresh_gauges()
        finally:
            self._fail_all(
                EngineDeadError(f"the inference engine stopped ({self._error or 'shutdown'})")
            )

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._refresh_gauges()

    def _apply(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params = cmd
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is None:
                return
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except Exception as exc:  # bad prompt or params: hand the error to the caller
                self._forget(request_id)
                self._deliver(stream.loop, [(stream, exc)])
        elif kind == "abort":
            try:
                self.engine.abort(cmd[1])  # a no-op for ids the engine no longer has
            except Exception:
                logger.debug("abort(%s) ignored by the engine", cmd[1])

    def _forget(self, request_id: str) -> RequestStream | None:
        with self._lock:
            self._pending.discard(request_id)
            return self._streams.pop(request_id, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        num_new = 0
        for out in outputs:
            num_new += len(out.new_token_ids)
            with self._lock:
                stream = self._streams.get(out.request_id)
                self._pending.discard(out.request_id)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            if out.finished:
                ttft, tpot, latency = request_timings(out)
                self.metrics.record_finished(
                    out.finish_reason, len(out.prompt_token_ids), ttft, tpot, latency
                )
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        self.metrics.record_step(num_new)
        for loop, items in by_loop.items():
            self._deliver(loop, items)

    def _deliver(
        self, loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, Any]]
    ) -> None:
        def put_all() -> None:
            for stream, item in items:
                stream._put(item)

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            for stream, _ in items:
                self._commands.put(("abort", stream.request_id))

    def _refresh_gauges(self) -> None:
        stats = self.engine.stats()
        self.metrics.set_gauges(
            EngineGauges(
                num_waiting=int(getattr(stats, "num_waiting", 0)),
                num_running=int(getattr(stats, "num_running", 0)),
                kv_blocks_used=int(getattr(stats, "kv_blocks_used", 0)),
                kv_blocks_total=int(getattr(stats, "kv_blocks_total", 0)),
            )
        )

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._pending.clear()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream in streams:
            by_loop.setdefault(stream.loop, []).append((stream, error))
            try:
                self.engine.abort(stream.request_id)
            except Exception:
                pass
        for loop, items in by_loop.items():
            self._deliver(loop, items)
