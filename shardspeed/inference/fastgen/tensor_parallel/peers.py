"""Rank 0's side of a tensor-parallel engine: spawn the workers, connect, drive each step.

The caller's process is rank 0 and runs the whole engine (scheduler, sampler,
tokenizer, its own shard of the model); ranks 1..T-1 are spawned worker processes
(:mod:`.worker`) that hold the other shards and their part of the KV cache. Each
step rank 0 sends the scheduled batch to every worker over its pipe, then all ranks
run the forward, whose all-reduces keep them in step; only rank 0 computes logits.

Lifetime: workers are daemon processes that also exit on pipe EOF, so they end with
:meth:`TensorParallelPeers.shutdown`, when the engine is garbage-collected
(``weakref.finalize``) or when the caller exits, however it exits. A worker that
fails sends its traceback and exits; rank 0 then raises :class:`TensorParallelError`
(a dead peer fails the pending collective at once, a hung one after
:data:`~.group.COLLECTIVE_TIMEOUT_S`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.models.tp_shard import TensorShard
from shardspeed.inference.fastgen.scheduler import ScheduledBatch
from shardspeed.inference.fastgen.tensor_parallel import messages as msg
from shardspeed.inference.fastgen.tensor_parallel.errors import TensorParallelError
from shardspeed.inference.fastgen.tensor_parallel.group import (
    GroupHandle,
    new_process_group,
    open_store,
)
from shardspeed.inference.fastgen.tensor_parallel.worker import WorkerArgs, worker_main
from shardspeed.inference.fastgen.worker_entry import await_replies, stop_workers
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

STARTUP_TIMEOUT_S = 600.0  # spawn + import + load of one worker
_ERROR_GRACE_S = 2.0  # how long a failure waits for the workers' own error messages


def worker_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """Each rank's device: CPU for all on CPU; ``cuda:(i + r)`` from rank 0's ``cuda:i``."""
    if device.type != "cuda":
        return [device] * world_size
    first = device.index if device.index is not None else torch.cuda.current_device()
    available = torch.cuda.device_count()
    if first + world_size > available:
        raise ValueError(
            f"EngineConfig.tensor_parallel={world_size} on {device} needs CUDA devices "
            f"cuda:{first}..cuda:{first + world_size - 1}, but {available} are visible; lower "
            "tensor_parallel, pick device='cuda:0' or expose more GPUs (CUDA_VISIBLE_DEVICES)."
        )
    return [torch.device("cuda", first + r) for r in range(world_size)]


class TensorParallelPeers:
    """The workers of one engine and the group they share with rank 0 (this process).

    ``shard`` is rank 0's :class:`TensorShard`; its all-reduce works once
    :meth:`connect` has returned.
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self._handle = GroupHandle()
        self.shard = TensorShard(0, world_size, self._handle.all_reduce)
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._store: Any = None
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, stop_workers, self._procs, self._conns, msg.STOP)

    @classmethod
    def spawn(
        cls,
        source: Any,
        world_size: int,
        dtype: torch.dtype | None,
        device: torch.device,
        quantization: Any = None,
        cpu_prepack: bool | None = None,
    ) -> TensorParallelPeers:
        """Start ranks 1..``world_size - 1`` loading ``source`` (a path or CheckpointSource),
        quantized with ``quantization`` (a ``WeightQuantConfig`` or None)."""
        devices = worker_devices(device, world_size)
        peers = cls(world_size, device)
        ctx = mp.get_context("spawn")
        num_threads = torch.get_num_threads()  # each rank as many as the caller
        try:
            for rank in range(1, world_size):
                ours, theirs = ctx.Pipe(duplex=True)
                args = WorkerArgs(
                    rank,
                    world_size,
                    source,
                    dtype,
                    str(devices[rank]),
                    num_threads,
                    quantization,
                    cpu_prepack,
                )
                proc = ctx.Process(
                    target=worker_main, args=(theirs, args), daemon=True, name=f"fastgen-tp{rank}"
                )
                proc.start()
                theirs.close()
                peers._procs.append(proc)
                peers._conns.append(ours)
        except BaseException:
            peers.shutdown()
            raise
        logger.info(
            "tensor parallel: %d ranks (this process + workers %s) on %s",
            world_size, [p.pid for p in peers._procs], [str(d) for d in devices],
        )  # fmt: skip
        return peers

    @property
    def worker_pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------------ start-up
    def connect(self, kv_spec: KVCacheSpec, num_blocks: int, backend: str) -> KVCache:
        """Wait for the workers' models, form the group, allocate every rank's KV cache.

        Returns rank 0's cache, whose ``copy_block`` also runs on the workers.
        """
        try:
            self._wait_all(msg.LOADED)
            self._store = open_store(self.world_size)
            info = msg.ConnectInfo(self._store.port, kv_spec, num_blocks, backend)
            self._send_all((msg.CONNECT, info))
            self._handle.group = new_process_group(self._store, 0, self.world_size, self.device)
            cache = ShardedKVCache(kv_spec, num_blocks, self.device, self)
            self._wait_all(msg.READY)
        except TensorParallelError:
            self.shutdown()
            raise
        except BaseException as exc:
            error = self._failure(exc)
            self.shutdown()
            raise error from exc
        return cache

    def _wait_all(self, expected: str) -> None:
        names = [f"worker rank {rank}" for rank in range(1, len(self._procs) + 1)]
        workers = list(zip(names, self._procs, self._conns))
        await_replies(workers, expected, STARTUP_TIMEOUT_S, lambda why: self._failure(None, why))

    # --------------------------------------------------------------------- steps
    def execute(self, batch: ScheduledBatch, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Send ``batch`` to the workers, run rank 0's ``forward`` in step with theirs."""
        self._send_all((msg.BATCH, msg.pack_batch(batch)))
        try:
            return forward()
        except Exception as exc:
            error = self._failure(exc)
            self._abort()  # peers may wait in a collective rank 0 will never join
            raise error from exc

    def copy_block(self, src: int, dst: int) -> None:
        """Have every worker copy KV block ``src`` into ``dst`` (before its next forward)."""
        self._send_all((msg.COPY_BLOCK, (src, dst)))

    def _send_all(self, message: tuple[str, Any]) -> None:
        if self._broken is not None:
            raise TensorParallelError(
                f"the tensor-parallel group is down ({self._broken}); create a new engine."
            )
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            try:
                if not proc.is_alive():
                    raise BrokenPipeError(f"worker rank {rank} exited (code {proc.exitcode})")
                conn.send(message)
            except (OSError, ValueError) as exc:
                error = self._failure(exc)
                self.shutdown()
                raise error from exc

    # ------------------------------------------------------------------ failures
    def _failure(self, exc: BaseException | None, what: str | None = None) -> TensorParallelError:
        """A :class:`TensorParallelError` naming ``what``/``exc`` and what the workers reported."""
        reports = self._worker_reports()
        if what is None and exc is not None:
            what = f"rank 0: {type(exc).__name__}: {exc}"
        lines = [what or "unknown failure", *reports]
        self._broken = lines[0]
        return TensorParallelError(
            "tensor-parallel engine failed; " + "\n".join(lines) + "\nCreate a new engine "
            "(or pipeline) to continue."
        )

    def _worker_reports(self) -> list[str]:
        """Error messages and exit codes the workers left (waits up to a short grace)."""
        reports = []
        deadline = time.monotonic() + _ERROR_GRACE_S
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
            try:
                while proc.is_alive() and not conn.poll(0.05) and time.monotonic() < deadline:
                    pass
                while conn.poll(0):
                    kind, payload = conn.recv()
                    if kind == msg.ERROR:
                        reports.append(f"worker rank {rank} failed:\n{payload}")
            except (OSError, EOFError):  # pipe closed: the worker is gone or going
                proc.join(timeout=max(0.0, deadline - time.monotonic()))  # reap its exit code
            if proc.exitcode not in (None, 0) and not any(f"rank {rank} " in r for r in reports):
                reports.append(f"worker rank {rank} exited with code {proc.exitcode}")
        return reports

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the workers (idempotent); the engine cannot step afterwards."""
        if self._broken is None:
            self._broken = "shut down"
        self._finalizer()
        self._handle.group = None

    def _abort(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        self.shutdown()

    @property
    def alive(self) -> bool:
        return self._broken is None


class ShardedKVCache(KVCache):
    """Rank 0's KV cache; a block copy (forking a sample) is mirrored on every worker."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device, peers: TensorParallelPeers
    ) -> None:
        super().__init__(spec, num_blocks, device)
        self._peers = peers

    def copy_block(self, src: int, dst: int) -> None:
        self._peers.copy_block(src, dst)
        super().copy_block(src, dst)
