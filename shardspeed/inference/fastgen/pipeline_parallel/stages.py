"""Rank 0's side of a pipeline-parallel engine: spawn the stage workers, connect, launch
micro-batches, collect the last stage's results.

The caller's process is rank 0 = stage 0 (embeddings and the first layers) and runs
the scheduler, sampler and tokenizer; ranks 1..P-1 are spawned workers
(:mod:`.worker`) holding the later stages and their part of the KV cache. Per
micro-batch rank 0 sends the batch description to every worker over its pipe, runs
stage 0 and sends the hidden states to stage 1 with a point-to-point send; the last
stage answers over its pipe. Nothing here waits for a micro-batch except
:meth:`PipelineStages.collect`, so rank 0 can launch the next one while the others run.

With ``tensor_parallel=T`` each stage is ``T`` ranks (:mod:`.grid`): rank 0 also holds
stage 0's tensor rank 0 and its all-reduce; every other rank is a worker, and the last
stage's tensor rank 0 answers for its stage.

Lifetime and failures as FastGen tensor parallelism (:mod:`..tensor_parallel.peers`):
daemon workers that also exit on pipe EOF; a dead or failing worker makes rank 0
raise :class:`PipelineParallelError` naming it, after every worker is stopped.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.pipeline_parallel import messages as msg
from shardspeed.inference.fastgen.pipeline_parallel.errors import PipelineParallelError
from shardspeed.inference.fastgen.pipeline_parallel.grid import (
    grid_ranks,
    join_groups,
    tensor_shard,
)
from shardspeed.inference.fastgen.pipeline_parallel.partition import StageLayout
from shardspeed.inference.fastgen.pipeline_parallel.worker import (
    StageWorkerArgs,
    stage_worker_main,
)
from shardspeed.inference.fastgen.scheduler import ScheduledBatch
from shardspeed.inference.fastgen.tensor_parallel.group import GroupHandle, open_store
from shardspeed.inference.fastgen.tensor_parallel.peers import worker_devices
from shardspeed.inference.fastgen.worker_entry import await_replies, stop_workers
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

STARTUP_TIMEOUT_S = 600.0  # spawn + import + load of one worker
RESULT_TIMEOUT_S = 300.0  # a micro-batch whose result takes longer fails the engine
_ERROR_GRACE_S = 2.0  # how long a failure waits for the workers' own error messages

Result = tuple[list[int], torch.Tensor]  # (argmax tokens, logits rows [R, V] fp32)


class PipelineStages:
    """The stage workers of one engine and the groups they share with rank 0 (stage 0).

    ``shard`` is rank 0's :class:`~.models.tp_shard.TensorShard` (stage 0's tensor rank 0;
    unsharded without tensor parallelism); its all-reduce works once :meth:`connect` returned.
    """

    def __init__(self, layouts: list[StageLayout], device: torch.device, tp_size: int = 1) -> None:
        self.layouts = layouts
        self.num_stages = len(layouts)
        self.tp_size = tp_size
        self.device = device
        everyone = grid_ranks(self.num_stages, tp_size)
        self.me = everyone[0]
        self.ranks = everyone[1:]  # the workers', in the order of _procs / _conns
        self._names = [r.name for r in self.ranks]
        self._last = next(i for i, r in enumerate(self.ranks) if r.reports_results)
        self._handle = GroupHandle()  # stage 0's tensor group
        self.shard = tensor_shard(self.me, self._handle)
        self.infos: list[msg.StageInfo] = []  # workers' reports, in rank order
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._group: Any = None
        self._store: Any = None
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()  # hidden states in flight
        self._results: deque[Result] = deque()  # results read ahead of a timers reply
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, stop_workers, self._procs, self._conns, msg.STOP)

    @classmethod
    def spawn(
        cls,
        source: Any,
        layouts: list[StageLayout],
        dtype: torch.dtype | None,
        device: torch.device,
        quantization: Any = None,
        tp_size: int = 1,
        cpu_prepack: bool | None = None,
    ) -> PipelineStages:
        """Start every rank but this one loading its layers of ``source`` (path or
        CheckpointSource): stages 1..P-1, and with ``tp_size > 1`` each stage's tensor ranks."""
        devices = worker_devices(device, len(layouts) * tp_size)
        stages = cls(layouts, device, tp_size)
        ctx = mp.get_context("spawn")
        num_threads = torch.get_num_threads()  # each rank as many as the caller
        _warn_oversubscribed(device, len(layouts) * tp_size, num_threads)
        try:
            for where in stages.ranks:
                ours, theirs = ctx.Pipe(duplex=True)
                args = StageWorkerArgs(
                    layouts[where.stage], source, dtype, str(devices[where.rank]), num_threads,
                    quantization, where.tp_rank, tp_size, cpu_prepack,
                )  # fmt: skip
                tp = f"tp{where.tp_rank}" if tp_size > 1 else ""
                proc = ctx.Process(
                    target=stage_worker_main,
                    args=(theirs, args),
                    daemon=True,
                    name=f"fastgen-pp{where.stage}{tp}",
                )
                proc.start()
                theirs.close()
                stages._procs.append(proc)
                stages._conns.append(ours)
        except BaseException:
            stages.shutdown()
            raise
        logger.info(
            "pipeline parallel: %d stages x %d tensor ranks, layers %s (this process + "
            "workers %s) on %s",
            len(layouts), tp_size, [(s.first_layer, s.end_layer) for s in layouts],
            [p.pid for p in stages._procs], [str(d) for d in devices],
        )  # fmt: skip
        return stages

    @property
    def worker_pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return self._broken is None

    @property
    def failure(self) -> str | None:
        """Why the stages went down when a failure (not a shutdown) stopped them."""
        return None if self._broken in (None, "shut down") else self._broken

    # ------------------------------------------------------------------ start-up
    def connect(self, kv_specs: list[KVCacheSpec], num_blocks: int, backend: str) -> None:
        """Wait for the workers' stages, form the group, allocate every stage's KV cache."""
        try:
            self.infos = self._wait_all(msg.LOADED)
            self._store = open_store(self.num_stages * self.tp_size)
            for where, conn in zip(self.ranks, self._conns, strict=True):
                info = msg.ConnectInfo(self._store.port, kv_specs[where.stage], num_blocks, backend)
                conn.send((msg.CONNECT, info))
            self._group = join_groups(self._store, self.me, self._handle, self.device)
            self._wait_all(msg.READY)
        except PipelineParallelError:
            self.shutdown()
            raise
        except BaseException as exc:
            error = self._failure(exc)
            self.shutdown()
            raise error from exc

    def _wait_all(self, expected: str) -> list[Any]:
        workers = list(zip(self._names, self._procs, self._conns))
        return await_replies(
            workers, expected, STARTUP_TIMEOUT_S, lambda why: self._failure(None, why)
        )

    # ------------------------------------------------------------ micro-batches
    def send_batch(self, batch: ScheduledBatch, modes: list[int]) -> None:
        """Describe a micro-batch to every stage (before stage 0 runs it)."""
        self._send_all((msg.BATCH, (msg.pack_batch(batch), modes)))

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """Hand stage 0's output ``[N, hidden]`` to stage 1 (returns before it is received)."""
        self._check_alive()
        try:
            self._sends.append((self._group.send([hidden], 1, 0), hidden))
        except Exception as exc:
            raise self._fail(exc) from exc

    def copy_block(self, src: int, dst: int) -> None:
        """Have every stage copy KV block ``src`` into ``dst`` (after the batches sent before)."""
        self._send_all((msg.COPY_BLOCK, (src, dst)))

    def collect(self) -> Result:
        """The last stage's result of the oldest micro-batch not yet collected (blocks)."""
        if self._results:
            result = self._results.popleft()
        else:
            kind, payload = self._recv_last()
            if kind != msg.RESULT:
                raise self._fail(None, f"{self._names[self._last]} sent {kind!r}, not a result")
            result = _as_result(payload)
        if self._sends:  # stage 1 took this batch's hidden states long ago
            work, _ = self._sends.popleft()
            work.wait()
        return result

    def stage_times(self, reset: bool) -> list[msg.StageTimes]:
        """Stages 1..P-1's timers (each stage's tensor rank 0), optionally reset; results
        read past are kept."""
        self._send_all((msg.TIMERS, reset))
        # The result sender first: it answers after the results of the micro-batches in
        # flight, which would otherwise arrive while another worker's reply is awaited.
        order = [self._last, *(i for i in range(len(self.ranks)) if i != self._last)]
        replies: dict[int, msg.StageTimes] = {}
        early: dict[int, tuple[str, Any]] = {}  # replies that came while another was awaited
        for i in order:
            while True:
                kind, payload = early.pop(i) if i in early else self._recv(i, early)
                if kind == msg.TIMERS:
                    replies[i] = payload
                    break
                if kind == msg.RESULT and i == self._last:
                    self._results.append(_as_result(payload))
                    continue
                raise self._fail(None, f"{self._names[i]} sent {kind!r}, not its timers")
        return [replies[i] for i, where in enumerate(self.ranks) if where.tp_rank == 0]

    def _recv_last(self) -> tuple[str, Any]:
        return self._recv(self._last)

    def _recv(self, index: int, early: dict[int, tuple[str, Any]] | None = None) -> tuple[str, Any]:
        """The next message of worker ``index``, watching every worker for death or an error.

        With ``early`` (while timers are collected) another worker's timers reply is kept
        there instead of failing the engine.
        """
        self._check_alive()
        conn, name = self._conns[index], self._names[index]
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        try:
            while not conn.poll(0.02):
                for i, (proc, other) in enumerate(zip(self._procs, self._conns)):
                    if i != index and other.poll(0):  # the others send errors (or timers) here
                        kind, payload = other.recv()
                        if early is not None and kind == msg.TIMERS and i not in early:
                            early[i] = (kind, payload)
                            continue
                        what = payload if kind == msg.ERROR else f"an unasked {kind!r}"
                        raise self._fail(None, f"{self._names[i]} failed:\n{what}")
                    if not proc.is_alive():
                        raise self._fail(None, f"{self._names[i]} exited (code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise self._fail(None, f"{name} sent nothing in {RESULT_TIMEOUT_S} s")
            kind, payload = conn.recv()
        except (OSError, EOFError) as exc:
            raise self._fail(exc) from exc
        if kind == msg.ERROR:
            raise self._fail(None, f"{name} failed:\n{payload}")
        return kind, payload

    def _send_all(self, message: tuple[str, Any]) -> None:
        self._check_alive()
        for name, proc, conn in zip(self._names, self._procs, self._conns):
            try:
                if not proc.is_alive():
                    raise BrokenPipeError(f"{name} exited (code {proc.exitcode})")
                conn.send(message)
            except (OSError, ValueError) as exc:
                raise self._fail(exc) from exc

    # ------------------------------------------------------------------ failures
    def _check_alive(self) -> None:
        if self._broken is not None:
            raise PipelineParallelError(
                f"the pipeline-parallel stages are down ({self._broken}); create a new engine."
            )

    def fail(self, exc: BaseException) -> PipelineParallelError:
        """Stop every stage after rank 0's own ``exc`` mid-batch; the error to raise."""
        return self._fail(exc)

    def _fail(self, exc: BaseException | None, what: str | None = None) -> PipelineParallelError:
        """The error to raise for a failure now; every worker is stopped first."""
        error = self._failure(exc, what)
        self.shutdown(terminate=True)
        return error

    def _failure(self, exc: BaseException | None, what: str | None = None) -> PipelineParallelError:
        reports = self._worker_reports()
        if what is None:  # a dead or failed stage is the cause; rank 0's error its effect
            what = reports[0] if reports else None
            reports = reports[1:]
            if exc is not None:
                reports.append(f"rank 0: {type(exc).__name__}: {exc}")
        lines = [what or "unknown failure", *(r for r in reports if r not in (what or ""))]
        self._broken = lines[0].splitlines()[0]
        return PipelineParallelError(
            "pipeline-parallel engine failed; " + "\n".join(lines) + "\nCreate a new engine "
            "(or pipeline) to continue."
        )

    def _worker_reports(self) -> list[str]:
        """Error messages and exit codes the workers left (waits up to a short grace)."""
        reports = []
        deadline = time.monotonic() + _ERROR_GRACE_S
        for name, proc, conn in zip(self._names, self._procs, self._conns):
            try:
                while proc.is_alive() and not conn.poll(0.05) and time.monotonic() < deadline:
                    pass
                while conn.poll(0):
                    kind, payload = conn.recv()
                    if kind == msg.ERROR:
                        reports.append(f"{name} failed:\n{payload}")
            except (OSError, EOFError):  # pipe closed: the worker is gone or going
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.exitcode not in (None, 0) and not any(f"{name} " in r for r in reports):
                reports.append(f"{name} exited with code {proc.exitcode}")
        return reports

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, terminate: bool = False) -> None:
        """Stop the workers (idempotent); with ``terminate`` do not ask them first."""
        if self._broken is None:
            self._broken = "shut down"
        if terminate:
            for proc in self._procs:
                if proc.is_alive():
                    proc.terminate()
        self._finalizer()
        self._sends.clear()
        self._group = None
        self._handle.group = None


def _warn_oversubscribed(device: torch.device, world_size: int, num_threads: int) -> None:
    """Warn when CPU ranks would run more torch threads than the machine has cores: the
    ranks' spinning thread pools then slow every step many times over (measured 20x at
    2 stages x 2 tensor ranks x 2 threads on 2 cores)."""
    cores = os.cpu_count() or 1
    if device.type == "cpu" and num_threads > max(1, cores // world_size):
        logger.warning(
            "pipeline parallel on CPU: %d ranks x torch.get_num_threads()=%d threads > %d cores; "
            "call torch.set_num_threads(%d) before building the engine (every rank copies it).",
            world_size, num_threads, cores, max(1, cores // world_size),
        )  # fmt: skip


def _as_result(payload: tuple[list[int], np.ndarray]) -> Result:
    tokens, rows = payload
    return tokens, torch.from_numpy(rows)


class PipelineKVCache(KVCache):
    """Stage 0's KV cache; a block copy (forking a sample) is mirrored on every stage."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device, stages: PipelineStages
    ) -> None:
        super().__init__(spec, num_blocks, device)
        self._stages = stages

    def copy_block(self, src: int, dst: int) -> None:
        self._stages.copy_block(src, dst)
        super().copy_block(src, dst)
