"""The private process group of one tensor-parallel engine (never the default group).

Rank 0 (the caller's process) opens a ``TCPStore`` on a free port; every rank then
builds a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) on it directly,
so a user's own ``torch.distributed`` default group is neither needed nor touched.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.inference.fastgen.tensor_parallel.errors import TensorParallelError

HOST = "127.0.0.1"
# How long one collective (or the group's rendezvous) may wait for a peer: a rank that
# hangs this long fails the step instead of hanging it (a crashed peer fails it at once).
COLLECTIVE_TIMEOUT_S = 300.0


def open_store(world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's store on a free local port (``store.port``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(HOST, 0, world_size, True, timeout, wait_for_workers=False)


def join_store(
    port: int, world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> dist.TCPStore:
    """A worker's client of rank 0's store."""
    return dist.TCPStore(HOST, port, world_size, False, datetime.timedelta(seconds=timeout_s))


def new_process_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    name: str = "fastgen_tp",
) -> Any:
    """A gloo (CPU) or NCCL (CUDA) group of ``world_size`` ranks on ``store``; blocks until all join.

    ``name`` keys the group's rendezvous in ``store``: several groups (pipeline x tensor
    parallel builds one per stage and one per tensor rank) share one store by name.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(name, store)
    if device.type == "cuda":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise TensorParallelError(
                "tensor_parallel on CUDA needs NCCL, but this torch build has no ProcessGroupNCCL."
            )
        options = nccl.Options()
        options._timeout = timeout
        return nccl(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


@dataclass
class GroupHandle:
    """The group once connected; ``all_reduce`` is handed to models before it is."""

    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place and return it."""
        if self.group is None:
            raise TensorParallelError(
                "tensor-parallel all-reduce before the group was connected (internal error)."
            )
        self.group.allreduce([x]).wait()
        return x
