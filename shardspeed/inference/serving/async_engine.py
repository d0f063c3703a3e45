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

Faults, from narrow to wide:

* a request the engine finishes with ``finish_reason="error"`` (its forward, sampling
  or stop checks raised; see ``InferenceEngine.step``) fails alone: its stream raises
  :class:`RequestFailedError`, the others go on;
* anything else that escapes the loop (``step()`` itself raising, a bug here) ends the
  engine thread: every in-flight request fails with :class:`EngineDeadError`, the
  engine's requests are aborted, and a supervisor thread starts a new engine thread
  after ``restart_backoff_s`` (doubling while restarts keep failing before a step
  succeeds, up to ``max_restart_backoff_s``). :attr:`restarts` counts them; ``/health``
  answers 503 until the new thread runs;
* an error after which the engine itself can never step again (a tensor-parallel worker
  died: :class:`TensorParallelError`, or any exception with a true
  ``engine_unrecoverable`` attribute) is not retried: the supervisor shuts the engine
  down (its surviving workers exit), ``/health`` answers 503 naming the error for good,
  and new requests fail at once with :class:`EngineDeadError` - restarting the process is
  the way back, which an orchestrator watching ``/health`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shardspeed.inference.fastgen.engine import RequestFailedError
from shardspeed.inference.fastgen.tensor_parallel import TensorParallelError
from shardspeed.inference.serving.metrics import EngineGauges, ServingMetrics
from shardspeed.inference.serving.pipeline import request_timings
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.outputs import RequestOutput
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

logger = get_logger(__name__)
__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "QueueFullError",
    "RequestFailedError",
    "RequestStream",
]


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
    :class:`QueueFullError` beyond it. ``restart_backoff_s`` and
    ``max_restart_backoff_s`` pace the restarts of a dead engine thread.
    """

    def __init__(
        self,
        engine: Any,
        max_queue: int = 256,
        metrics: ServingMetrics | None = None,
        restart_backoff_s: float = 1.0,
        max_restart_backoff_s: float = 30.0,
    ) -> None:
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} is invalid: it must be an int >= 1.")
        if not 0 <= restart_backoff_s <= max_restart_backoff_s:
            raise ValueError(
                f"restart_backoff_s={restart_backoff_s!r}, max_restart_backoff_s="
                f"{max_restart_backoff_s!r} are invalid: need 0 <= restart_backoff_s <= "
                "max_restart_backoff_s."
            )
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self.restart_backoff_s = restart_backoff_s
        self.max_restart_backoff_s = max_restart_backoff_s
        self.restarts = 0
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._pending: set[str] = set()  # accepted, no output yet
        self._in_engine: set[str] = set()  # added to the engine, not seen finished
        self._stop = threading.Event()
        self._error: BaseException | None = None  # why the current engine thread ended
        self._fatal: BaseException | None = None  # an error no restart can cure
        self._stepped = False  # a step succeeded since the last (re)start
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None  # the current engine thread
        self._first_start = threading.Event()  # the first engine thread is running
        self._supervisor = threading.Thread(
            target=self._supervise, name="shardspeed-engine-supervisor", daemon=True
        )

    # ---- asyncio side -------------------------------------------------------------------

    def start(self) -> AsyncEngine:
        """Start the engine thread and its supervisor (idempotent); returns self."""
        with self._lock:
            if not self._supervisor.is_alive() and not self._stop.is_set():
                self._thread = self._new_thread()
                self._supervisor.start()
        if self._supervisor.is_alive():
            self._first_start.wait(10.0)  # healthy on return: a request right away is served
        return self

    @property
    def is_healthy(self) -> bool:
        """True while an engine thread runs (after a restart too) and has not failed."""
        thread = self._thread
        return (
            thread is not None
            and thread.is_alive()
            and self._error is None
            and not self._stop.is_set()
        )

    @property
    def status_detail(self) -> str:
        """Why the engine cannot serve now ("" when healthy)."""
        if self.is_healthy:
            return ""
        if self._fatal is not None:
            return f"engine failed and cannot be restarted ({self._fatal}); restart the server"
        if self._stop.is_set() or self._thread is None:
            return "engine stopped"
        return f"engine restarting after: {self._error or 'its thread ended'}"

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
        return self.submit_samples(prompt, params, request_id)[0]

    def submit_samples(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[RequestStream]:
        """Like :meth:`submit`, with one stream per sample (``params.n`` / ``best_of``)."""
        from shardspeed.inference.fastgen.request import sample_request_ids

        if not self.is_healthy:
            raise EngineDeadError(f"the inference engine is not running ({self.status_detail})")
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        sample_ids = sample_request_ids(request_id, params.num_samples)
        streams = [RequestStream(sid, self, loop) for sid in sample_ids]
        with self._lock:
            if len(self._pending) >= self.max_queue:
                self.metrics.record_rejected()
                raise QueueFullError(
                    f"the server queue is full ({self.max_queue} requests waiting); retry later "
                    "or start the server with a larger max_queue"
                )
            if any(sid in self._streams for sid in sample_ids):
                raise ValueError(f"request_id={request_id!r} is already in use; pass a unique id.")
            for stream in streams:
                self._pending.add(stream.request_id)
                self._streams[stream.request_id] = stream
        self._commands.put(("add", request_id, prompt, params, sample_ids))
        return streams

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` (safe from any thread): it leaves the queue at once and the
        engine thread drops it before its next step."""
        self._forget(request_id)
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread, then the engine itself; unfinished requests fail with
        :class:`EngineDeadError`.

        Calls ``engine.shutdown()`` when the engine has one, so tensor-parallel workers
        and weight-offload threads/files go away now rather than at garbage collection.
        Idempotent (the engine's ``shutdown`` is called again, which it must tolerate).
        """
        self._stop.set()
        self._commands.put(("wake",))
        current = threading.current_thread()
        for thread in (self._supervisor, self._thread):
            if thread is not None and thread.is_alive() and thread is not current:
                thread.join(timeout)
        engine_shutdown = getattr(self.engine, "shutdown", None)
        if not callable(engine_shutdown):
            return
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not current:
            # a step still running after `timeout`: stopping the engine under it ends it
            # with an error (tensor-parallel workers gone) instead of leaving it hung
            logger.warning(
                "the engine thread did not stop within %.1f s; shutting the engine down anyway",
                timeout,
            )
        engine_shutdown()

    # ---- supervisor ---------------------------------------------------------------------

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="shardspeed-engine", daemon=True)

    def _supervise(self) -> None:
        """Run the engine thread; when it ends before shutdown, start a new one after a backoff."""
        backoff = self.restart_backoff_s
        while True:
            thread = self._thread
            assert thread is not None
            thread.start()
            self._first_start.set()
            thread.join()
            if self._stop.is_set():
                return
            if _unrecoverable(self._error):
                self._give_up()
                return
            backoff = self.restart_backoff_s if self._stepped else backoff
            logger.error(
                "the engine thread ended (%s); restarting it in %.1f s",
                self._error or "no error",
                backoff,
            )
            if self._stop.wait(backoff):
                return
            backoff = min(max(2 * backoff, 0.1), self.max_restart_backoff_s)
            self.restarts += 1
            self.metrics.record_restart()
            self._stepped = False
            self._thread = self._new_thread()
            self._error = None

    def _give_up(self) -> None:
        """The engine cannot step again: stop it (its workers exit) and stay unhealthy."""
        self._fatal = self._error
        logger.error(
            "the inference engine cannot recover (%s); not restarting it. /health reports it "
            "until the server is restarted",
            self._fatal,
        )
        engine_shutdown = getattr(self.engine, "shutdown", None)
        if callable(engine_shutdown):
            try:
                engine_shutdown()
            except Exception:  # already broken: cleaning up is best effort
                logger.exception("shutting the failed engine down raised")

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished())
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                outputs = self.engine.step()
                self._stepped = True
                self._dispatch(outputs)
                self._refresh_gauges()
        except BaseException as exc:  # step() or this loop failed: fail all, then restart
            logger.exception("the engine thread failed; failing all in-flight requests")
            self._error = exc
        finally:
            self._fail_all(
                EngineDeadError(f"the inference engine stopped ({self._error or 'shutdown'})")
            )
            self._abort_engine_requests()

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
            _, request_id, prompt, params, sample_ids = cmd
            with self._lock:
                streams = [self._streams.get(sid) for sid in sample_ids]
            if all(stream is None for stream in streams):
                return  # every sample was aborted before it reached the engine
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except Exception as exc:  # bad prompt or params: hand the error to the caller
                for sid, stream in zip(sample_ids, streams):
                    self._forget(sid)
                    if stream is not None:
                        self._deliver(stream.loop, [(stream, exc)])
                return
            for sid, stream in zip(sample_ids, streams):
                self._in_engine.add(sid)
                if stream is None:  # aborted while queued
                    self.engine.abort(sid)
        elif kind == "abort":
            self._in_engine.discard(cmd[1])
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
            item: Any = out
            if out.finished:
                self._in_engine.discard(out.request_id)
                ttft, tpot, latency = request_timings(out)
                self.metrics.record_finished(
                    out.finish_reason, len(out.prompt_token_ids), ttft, tpot, latency
                )
                if out.finish_reason == "error":
                    item = self._request_error(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, item))
        self.metrics.record_step(num_new)
        for loop, items in by_loop.items():
            self._deliver(loop, items)

    def _request_error(self, request_id: str) -> RequestFailedError:
        take_error = getattr(self.engine, "take_error", None)
        error = take_error(request_id) if callable(take_error) else None
        return error or RequestFailedError(f"request {request_id} failed in the engine")

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
        for loop, items in by_loop.items():
            self._deliver(loop, items)

    def _abort_engine_requests(self) -> None:
        """Abort everything the engine still holds, so a restarted thread starts clean."""
        for request_id in list(self._in_engine):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.debug("abort(%s) failed while resetting the engine", request_id)
        self._in_engine.clear()


def _unrecoverable(error: BaseException | None) -> bool:
    """Whether ``error`` leaves the engine unable to ever step again (no restart helps)."""
    if error is None:
        return False
    return isinstance(error, TensorParallelError) or bool(
        getattr(error, "engine_unrecoverable", False)
    )
