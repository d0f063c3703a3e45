"""``shardspeed.comm``: DeepSpeed's ``deepspeed.comm`` surface on ``torch.distributed``.

* :mod:`~shardspeed.comm.env`: launcher environment discovery (torchrun, MPI, Slurm).
* :mod:`~shardspeed.comm.backend`: ``init_distributed``, groups, ranks, the stored timeout.
* :mod:`~shardspeed.comm.collectives`: the collectives, with accounting and version shims.
* :mod:`~shardspeed.comm.logger`: the comms logger and the recent-ops ring buffer.
* :mod:`~shardspeed.comm.errors`, :mod:`~shardspeed.comm.guard`: timeout / failure /
  divergence errors with their reports, and the wrapper that raises them.
* :mod:`~shardspeed.comm.sequence`, :mod:`~shardspeed.comm.sequence_check`: collective-
  sequence fingerprints and the every-N-steps cross-rank check.
"""

from __future__ import annotations

from shardspeed.comm.backend import (
    destroy_process_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_timeout,
    get_world_group,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
)
from shardspeed.comm.collectives import (
    GuardedWork,
    P2POp,
    ReduceOp,
    TimedWork,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    gather,
    has_all_gather_into_tensor,
    has_coalescing_manager,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    irecv,
    isend,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    scatter,
    send,
)
from shardspeed.comm.env import DistEnv, discover_env
from shardspeed.comm.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
)
from shardspeed.comm.logger import (
    configure,
    current_tag,
    get_logged_comm_ops,
    log_summary,
    recent_ops,
    reset_log,
    set_current_tag,
)
from shardspeed.comm.sequence_check import CollectiveSequenceCheck
from shardspeed.utils.reset_hooks import register_reset_hook


def _reset_comm_globals() -> None:
    from shardspeed.comm import backend, logger

    logger.reset_state()
    backend.reset_state()


register_reset_hook(_reset_comm_globals)

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveSequenceCheck",
    "CollectiveTimeoutError",
    "DistEnv",
    "GuardedWork",
    "P2POp",
    "ReduceOp",
    "TimedWork",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "current_tag",
    "destroy_process_group",
    "discover_env",
    "gather",
    "get_global_rank",
    "get_local_rank",
    "get_logged_comm_ops",
    "get_rank",
    "get_timeout",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recent_ops",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reset_log",
    "scatter",
    "send",
    "set_current_tag",
]
