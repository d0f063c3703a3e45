"""The loop of an expert-parallel worker process (ranks 1..E-1).

::

    model = build_model(source, prepare=keep this rank's experts)   # others never load
    send loaded; wait for connect
    join the group; allocate the (replicated) KV cache; send ready
    loop: batch -> forward (its all-to-alls pair with rank 0's)  |  copy_block  |  stop

Same messages, lifetime and failure reporting as a tensor-parallel worker
(:mod:`shardspeed.inference.fastgen.tensor_parallel.worker`): rank 0 exiting ends
it, and an error is sent to rank 0 as a traceback before the worker exits.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from shardspeed.inference.fastgen.cpu_prepack import pack_worker_model
from shardspeed.inference.fastgen.expert_parallel.attach import attach_experts
from shardspeed.inference.fastgen.expert_parallel.comm import GroupComm
from shardspeed.inference.fastgen.expert_parallel.placement import ExpertPlacement
from shardspeed.inference.fastgen.kv_cache import KVCache
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.tensor_parallel import messages as msg
from shardspeed.inference.fastgen.tensor_parallel.group import (
    GroupHandle,
    join_store,
    new_process_group,
)
from shardspeed.inference.fastgen.worker_entry import run_worker, worker_device


@dataclass(frozen=True)
class ExpertWorkerArgs:
    """What an expert-parallel worker is started with (pickled to the spawned process)."""

    placement: ExpertPlacement  # its rank's
    source: Any  # a path string or a CheckpointSource
    dtype: torch.dtype | None
    device: str
    num_threads: int
    quantization: Any = None
    dispatch: str = "all_to_all"  # see dispatch.DISPATCHES
    cpu_prepack: bool | None = None  # EngineConfig.cpu_prepack


def expert_worker_main(conn: Connection, args: ExpertWorkerArgs) -> None:
    """Entry point of a spawned worker; returns when rank 0 says stop or goes away."""
    run_worker(_serve, conn, args, msg.ERROR)


def _serve(conn: Connection, args: ExpertWorkerArgs) -> None:
    device = worker_device(args.num_threads, args.device)
    rank, world_size = args.placement.rank, args.placement.ep_size
    handle = GroupHandle()
    comm = GroupComm(handle, world_size)
    model, _ = build_model(
        args.source, args.dtype, device, args.quantization,
        prepare=lambda m: attach_experts(m, args.placement, comm, args.dispatch),
    )  # fmt: skip
    pack_worker_model(model, args.cpu_prepack, device)  # as rank 0's model is packed
    conn.send((msg.LOADED, None))
    kind, info = conn.recv()
    if kind == msg.STOP:
        return
    assert kind == msg.CONNECT, kind
    store = join_store(info.port, world_size)
    handle.group = new_process_group(store, rank, world_size, device)
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
            raise RuntimeError(f"expert-parallel worker got an unknown message {kind!r}")
