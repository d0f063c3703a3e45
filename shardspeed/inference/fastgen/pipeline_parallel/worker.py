"""The loop of a pipeline stage worker process (every rank but rank 0, stage 0's first).

::

    stage = build_stage_model(source, layout, shard)   # only this stage's layers
                                                       # (this tensor rank's slices)
    send loaded; wait for connect
    join the groups (:mod:`.grid`); allocate this stage's KV cache; send ready
    loop (pipe messages, in rank 0's launch order):
        batch      -> first stage: embed; else recv hidden [N, hidden] from stage - 1;
                      run the layers (all-reduces with the stage's other tensor ranks);
                      send to stage + 1, or (last stage, tensor rank 0) send rank 0 the
                      result: argmax tokens of greedy rows, fp32 logits rows of the others
        copy_block | timers | stop

The worker blocks only on its pipe to rank 0, on a receive from the previous stage
or in its stage's all-reduce: rank 0 exiting (pipe EOF) ends it, a dead neighbour
fails its receive, send or all-reduce. On any error it sends the traceback to rank 0 and exits.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from shardspeed.inference.fastgen.cpu_prepack import pack_worker_model
from shardspeed.inference.fastgen.kv_cache import KVCache
from shardspeed.inference.fastgen.pipeline_parallel import messages as msg
from shardspeed.inference.fastgen.pipeline_parallel.grid import GridRank, join_groups, tensor_shard
from shardspeed.inference.fastgen.pipeline_parallel.partition import StageLayout
from shardspeed.inference.fastgen.pipeline_parallel.stage_model import build_stage_model
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.sampling import finite_logits
from shardspeed.inference.fastgen.scheduler import ScheduledBatch
from shardspeed.inference.fastgen.tensor_parallel.group import GroupHandle, join_store
from shardspeed.inference.fastgen.worker_entry import run_worker, worker_device

# Sends to the next stage not yet known complete; the oldest is waited for beyond this.
MAX_PENDING_SENDS = 8


@dataclass(frozen=True)
class StageWorkerArgs:
    """What a stage worker is started with (pickled to the spawned process)."""

    layout: StageLayout
    source: Any  # a path string or a CheckpointSource
    dtype: torch.dtype | None
    device: str
    num_threads: int
    quantization: Any = None
    tp_rank: int = 0  # this worker's tensor rank in its stage
    tp_size: int = 1  # tensor-parallel ranks per stage
    cpu_prepack: bool | None = None  # EngineConfig.cpu_prepack

    @property
    def where(self) -> GridRank:
        return GridRank(self.layout.stage, self.tp_rank, self.layout.num_stages, self.tp_size)


class StageTimer:
    """Time a stage spent waiting for its input since :meth:`reset`, and the window.

    Waiting is what the schedule is meant to remove: a worker blocked on its pipe or on
    the previous stage's hidden states, rank 0 blocked on the last stage's result.
    Everything else in the window (compute, sends, rank 0's scheduling) is busy time.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.start = self.last_end = time.perf_counter()
        self.wait_s = 0.0
        self.prep_s = 0.0
        self.num_batches = 0

    def add(self, end: float, wait_s: float, prep_s: float = 0.0) -> None:
        """A micro-batch finished at ``end`` after waiting ``wait_s`` for its input, having
        spent ``prep_s`` on work that needed no previous stage's output."""
        self.wait_s += wait_s
        self.prep_s += prep_s
        self.last_end = end
        self.num_batches += 1

    def times(self) -> msg.StageTimes:
        window = self.last_end - self.start
        return msg.StageTimes(window - self.wait_s, window, self.num_batches, self.prep_s)


def last_stage_result(
    logits: torch.Tensor, batch: ScheduledBatch, modes: list[int]
) -> tuple[list[int], torch.Tensor]:
    """``logits`` ``[M, V]`` (the batch's logits rows) -> (argmax token of each ``ARGMAX``
    sequence, the rows of the ``LOGITS`` sequences ``[R, V]``), both in batch order."""
    tokens: list[int] = []
    keep: list[int] = []
    row = 0
    for seq, mode in zip(batch.sequences, modes, strict=True):
        n = seq.num_logits_rows
        if mode == msg.ARGMAX:
            tokens.append(row + n - 1)
        elif mode == msg.LOGITS:
            keep.extend(range(row, row + n))
        row += n
    if tokens:  # as the one-process greedy draw: argmax of the finite-mapped logits
        tokens = finite_logits(logits[tokens]).argmax(dim=-1).tolist()
    return tokens, logits[keep]


def stage_worker_main(conn: Connection, args: StageWorkerArgs) -> None:
    """Entry point of a spawned stage worker; returns when rank 0 says stop or goes away."""
    run_worker(_serve, conn, args, msg.ERROR)


def _serve(conn: Connection, args: StageWorkerArgs) -> None:
    device = worker_device(args.num_threads, args.device)
    layout, where = args.layout, args.where
    handle = GroupHandle()  # the stage's tensor group, joined after load
    shard = tensor_shard(where, handle)
    stage = build_stage_model(args.source, layout, args.dtype, device, args.quantization, shard)
    pack_worker_model(stage.model, args.cpu_prepack, device)  # as stage 0's model is packed
    info = msg.StageInfo(stage.layer_bytes(), stage.total_bytes(), stage.hidden_size, stage.dtype)
    conn.send((msg.LOADED, info))
    kind, connect = conn.recv()
    if kind == msg.STOP:
        return
    assert kind == msg.CONNECT, kind
    store = join_store(connect.port, layout.num_stages * where.tp_size)
    group = join_groups(store, where, handle, device)  # the pipe of this tensor rank
    kv_cache = KVCache(connect.kv_spec, connect.num_blocks, device)
    conn.send((msg.READY, None))
    block_size = connect.kv_spec.block_size
    sends: deque[tuple[Any, torch.Tensor]] = deque()  # (work, tensor kept alive until sent)
    timer = StageTimer()
    waited = 0.0  # blocked on the pipe since the last micro-batch
    while True:
        begin = time.perf_counter()
        kind, payload = conn.recv()
        waited += time.perf_counter() - begin
        if kind == msg.BATCH:
            received = time.perf_counter()
            chunks, modes = payload
            batch = msg.unpack_batch(chunks)
            ragged = build_ragged_batch(batch, block_size, device, connect.backend)
            hidden, prep = None, 0.0  # the first stage embeds the batch itself
            if not layout.is_first:
                hidden = torch.empty(
                    ragged.num_tokens, stage.hidden_size, dtype=stage.dtype, device=device
                )
                begin = time.perf_counter()
                prep = begin - received  # overlaps the previous stages' work on this batch
                group.recv([hidden], layout.stage - 1, 0).wait()  # [N, hidden]
                waited += time.perf_counter() - begin
            out = stage.forward(ragged, kv_cache, hidden, head=where.reports_results)
            if where.reports_results:  # out: [M, vocab] fp32 logits rows
                tokens, rows = last_stage_result(out, batch, modes)
                conn.send((msg.RESULT, (tokens, rows.cpu().numpy())))
            elif not layout.is_last:  # out: [N, hidden]
                sends.append((group.send([out], layout.stage + 1, 0), out))
                while len(sends) > MAX_PENDING_SENDS:
                    sends.popleft()[0].wait()
            timer.add(time.perf_counter(), waited, prep)
            waited = 0.0
        elif kind == msg.COPY_BLOCK:
            kv_cache.copy_block(*payload)
        elif kind == msg.TIMERS:
            conn.send((msg.TIMERS, timer.times()))
            if payload:
                timer.reset()
                waited = 0.0  # the wait before the reset is outside the new window
        elif kind == msg.STOP:
            return
        else:
            raise RuntimeError(f"pipeline stage worker got an unknown message {kind!r}")
