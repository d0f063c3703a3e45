"""DeepSpeed's ``deepspeed.utils.groups`` (users import it as
:mod:`shardspeed.utils.groups`, a path served by this module; see
:data:`shardspeed._submodules.MOVED_MODULES`): the process-group getters, over the job's
:class:`~shardspeed.topology.Topology`.

It lives in ``runtime/`` because it answers with the mesh ``shardspeed.initialize`` used.
There are no group globals here: every getter asks
:data:`~shardspeed.parallel.topology_cache.TOPOLOGIES` for the job's mesh in this world (or,
before ``initialize``, builds the plain data-parallel one it would build, and keeps it
there for ``initialize`` to reuse). DeepSpeed's "model parallel" group in this module is
the tensor-parallel group; the expert getters take DeepSpeed's ``group_name``
(``"ep_size_N"``) and answer from that ``ep_size``'s expert groups (the ones its MoE layers
use).
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm
from shardspeed.config import load_config
from shardspeed.topology import Topology


def _topology() -> Topology:
    from shardspeed.parallel.topology_cache import TOPOLOGIES
    from shardspeed.runtime import initialize

    if not comm.is_initialized():
        raise RuntimeError(
            "shardspeed.utils.groups: torch.distributed is not initialised. Fix: call "
            "shardspeed.init_distributed() (or shardspeed.initialize(...)) first."
        )
    job = TOPOLOGIES.job()
    if job is not None:
        return job
    return initialize.build_topology(load_config({"train_batch_size": comm.get_world_size()}))


def _expert_topology(group_name: str) -> Topology:
    from shardspeed.parallel.moe.groups import ep_size_of, topology_for

    return topology_for(ep_size_of(group_name))


def _group(axis: str) -> Any:
    return _topology().group(axis)


def _size(axis: str) -> int:
    return _topology().size(axis)


def _rank(axis: str) -> int:
    return _topology().rank_in(axis)


# -- public getters (DeepSpeed's names) ----------------------------------------------------
def get_tensor_model_parallel_group() -> Any:
    return _group("tensor")


def get_tensor_model_parallel_world_size() -> int:
    return _size("tensor")


def get_tensor_model_parallel_rank() -> int:
    return _rank("tensor")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's tensor-parallel group."""
    return _topology().axis_ranks("tensor")[0]


def get_model_parallel_group() -> Any:
    return get_tensor_model_parallel_group()


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()


def get_data_parallel_group() -> Any:
    return _group("data")


def get_data_parallel_world_size() -> int:
    return _size("data")


def get_data_parallel_rank() -> int:
    return _rank("data")


# -- DeepSpeed's underscored getters that scripts and integrations call ---------------------
def _get_data_parallel_group() -> Any:
    return get_data_parallel_group()


def _get_data_parallel_world_size() -> int:
    return get_data_parallel_world_size()


def _get_data_parallel_rank() -> int:
    return get_data_parallel_rank()


def _get_model_parallel_world_size() -> int:
    return get_model_parallel_world_size()


def _get_broadcast_src_rank() -> int:
    return _topology().axis_ranks("data")[0]


def _get_sequence_parallel_group() -> Any:
    return _group("sequence")


def _get_sequence_parallel_world_size() -> int:
    return _size("sequence")


def _get_sequence_parallel_rank() -> int:
    return _rank("sequence")


def _get_sequence_data_parallel_group() -> Any:
    return _group("data_sequence")


def _get_sequence_data_parallel_world_size() -> int:
    return _size("data_sequence")


def _get_sequence_data_parallel_rank() -> int:
    return _rank("data_sequence")


def _get_expert_parallel_group(group_name: str) -> Any:
    return _expert_topology(group_name).group("expert")


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _expert_topology(group_name).size("expert")


def _get_expert_parallel_rank(group_name: str) -> int:
    return _expert_topology(group_name).rank_in("expert")


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _expert_topology(group_name).group("expert_data")


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _expert_topology(group_name).size("expert_data")


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _expert_topology(group_name).rank_in("expert_data")


__all__ = [
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
]
