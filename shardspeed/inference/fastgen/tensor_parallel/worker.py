"""The loop of a tensor-parallel worker process (ranks 1..T-1).

::

    model = build_model(source, shard=rank's TensorShard)     # slices (and quantizes) at load
    send loaded; wait for connect
    join the group; allocate this rank's KV cache; send ready
    loop: batch -> forward (all-reduces pair with rank 0's)  |  copy_block  |  stop

The worker only ever blocks on its pipe to rank 0 or inside a collective: rank 0
exiting (pipe EOF) ends it, and a dead peer fails its collective at once. On any
error it sends the traceback to rank 0 and exits, which breaks the group's
connections so rank 0's pending collective fails instead of waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from shardspeed.inference.fastgen.cpu_prepack import pack_worker_model
from shardspeed.inference.fastgen.kv_cache import KVCache
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.models.tp_shard import TensorShard
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.tensor_parallel import messages as msg
from shardspeed.inference.fastgen.tensor_parallel.group import (
    GroupHandle,
    join_store,
    new_process_group,
)
from shardspeed.inference.fastgen.worker_entry import run_worker, worker_device


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker is started with (pickled to the spawned process)."""

    rank: int
    world_size: int
    source: Any  # a path string or a CheckpointSource
    dtype: torch.dtype | None
    device: str
    num_threads: int
    quantization: Any = None  # a WeightQuantConfig (picklable) or None
    cpu_prepack: bool | None = None  # EngineConfig.cpu_prepack


def worker_main(conn: Connection, args: WorkerArgs) -> None:
    """Entry point of a spawned worker; returns when rank 0 says stop or goes away."""
    run_worker(_serve, conn, args, msg.ERROR)


def _serve(conn: Connection, args: WorkerArgs) -> None:
    device = worker_device(args.num_threads, args.device)
    handle = GroupHandle()
    shard = TensorShard(args.rank, args.world_size, handle.all_reduce)
    model, _ = build_model(args.source, args.dtype, device, args.quantization, shard)
    pack_worker_model(model, args.cpu_prepack, device)  # as rank 0's model is packed
    conn.send((msg.LOADED, None))
    kind, info = conn.recv()
    if kind == msg.STOP:
        return
    assert kind == msg.CONNECT, kind
    store = join_store(info.port, args.world_size)
    handle.group = new_process_group(store, args.rank, args.world_size, device)
    kv_cache = KVCache(info.kv_spec, info.num_blocks, device)
    conn.send((msg.READY, None))
    block_size = info.kv_spec.block_size
    while True:
        kind, payload = conn.recv()
        if kind == msg.BATCH:
            batch = msg.unpack_batch(payload)
            with torch.inference_mode():
                model(build_ragged_batch(batch, block_size, device, info.backend), kv_cache)
        elif kind == msg.COPY_BLOCK:
            kv_cache.copy_block(*payload)
        elif kind == msg.STOP:
            return
        else:
            raise RuntimeError(f"tensor-parallel worker got an unknown message {kind!r}")
