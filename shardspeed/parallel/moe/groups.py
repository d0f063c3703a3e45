"""Expert-parallel groups: one :class:`~shardspeed.topology.Topology` per ``ep_size``.

DeepSpeed's ``MoE`` creates its groups from ``ep_size`` alone (``deepspeed.utils.groups``,
group name ``"ep_size_<ep>"``). Here that is ``Topology.build(ep=ep_size)`` over the
current world (dp = world), built once per ``ep_size`` and kept for as long as the world
group lives (in :data:`~shardspeed.parallel.topology_cache.TOPOLOGIES`); its groups are
DeepSpeed's "E + D" groups::

    world 4, ep 2:  expert (all-to-all)      [0, 1] [2, 3]
                    expert_data (reduce)     [0, 2] [1, 3]

The engine finds the group that reduces an expert parameter's gradient with
:func:`expert_data_group_of` (from ``param.group_name``).
"""

from __future__ import annotations

import re
from typing import Any

from shardspeed import comm
from shardspeed.parallel.topology_cache import TOPOLOGIES
from shardspeed.topology import Topology

_GROUP_NAME = re.compile(r"ep_size_(\d+)")


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert groups of ``ep_size`` (``param.group_name``)."""
    return f"ep_size_{ep_size}"


def ep_size_of(group_name: str) -> int:
    """The ``ep_size`` in an expert group name ``"ep_size_<ep>"``."""
    match = _GROUP_NAME.fullmatch(str(group_name))
    if match is None:
        raise ValueError(
            f"expert group name {group_name!r} is not of the form 'ep_size_<int>' (the "
            "group_name an MoE layer gives its expert parameters)."
        )
    return int(match.group(1))


def topology_for(ep_size: int) -> Topology:
    """The topology (with groups) whose ``expert`` axis has ``ep_size`` ranks.

    Collective on first use for an ``ep_size`` (every rank must call it in the same order,
    as constructing the same MoE layers does).
    """
    if not comm.is_initialized():
        raise ValueError(
            f"MoE ep_size={ep_size} needs torch.distributed: call "
            "shardspeed.init_distributed() (or launch with torchrun) before building "
            "expert-parallel layers; a single process supports ep_size=1 only."
        )
    try:
        return TOPOLOGIES.axis_topology("expert", ep_size)
    except ValueError as exc:
        raise ValueError(
            f"MoE ep_size={ep_size} does not fit the world of {comm.get_world_size()} ranks: {exc}"
        ) from exc


def expert_parallel_group(group_name: str) -> Any:
    """The all-to-all group of ``group_name`` (``"ep_size_<ep>"``) containing this rank."""
    return topology_for(ep_size_of(group_name)).group("expert")


def expert_data_parallel_group(group_name: str) -> Any:
    """The group over which the experts of ``group_name`` are replicated (gradient reduce)."""
    return topology_for(ep_size_of(group_name)).group("expert_data")


def expert_data_group_of(param: Any) -> Any:
    """The group that reduces ``param``'s gradient: ``expert_data`` for an expert param."""
    group_name = getattr(param, "group_name", None)
    if getattr(param, "allreduce", True) or group_name is None:
        raise ValueError(
            "expert_data_group_of: the parameter is not an expert parameter (it lacks "
            "allreduce=False and group_name); dense parameters reduce over the data axis."
        )
    return expert_data_parallel_group(group_name)
