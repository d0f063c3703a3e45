"""Where tensor-parallel layers get their process group: one cached Topology per tp size.

The tensor axis is a :class:`~shardspeed.topology.Topology` axis like any other (DeepSpeed's
grid, tensor innermost: ranks ``[0, 1]``, ``[2, 3]``, ... at tp=2). Layers built without an
explicit ``group`` and :func:`~shardspeed.parallel.tensor.autotp.tp_model_init` without a
``tp_group`` use :func:`topology_for`, which builds ``Topology.build(tp=tp_size)`` once per
world and tp size (kept in :data:`~shardspeed.parallel.topology_cache.TOPOLOGIES`); the engine can hand in its own mesh with :func:`register_topology`
(before sharding) or fetch this one, so both sides use the same groups.
"""

from __future__ import annotations

from typing import Any

from shardspeed.parallel.topology_cache import TOPOLOGIES
from shardspeed.topology import Topology


def register_topology(topology: Topology) -> None:
    """Make ``topology`` (e.g. the engine's mesh) the one for its tensor degree."""
    TOPOLOGIES.register(topology, "tensor")


def topology_for(tp_size: int) -> Topology:
    """The job's Topology with a tensor axis of ``tp_size`` (built on first use; collective)."""
    return TOPOLOGIES.axis_topology("tensor", tp_size)


def tensor_group(tp_size: int) -> Any:
    """The tensor-axis process group of this rank at ``tp_size``."""
    return topology_for(tp_size).group("tensor")


def default_tensor_group() -> Any:
    """The tensor group of the one Topology built or registered in this world.

    For layers constructed without ``group=``: unambiguous only when exactly one tp size > 1
    is in use; otherwise the caller must pass the group.
    """
    live = TOPOLOGIES.live("tensor")
    if len(live) != 1:
        sizes = sorted(t.tp for t in live)
        raise ValueError(
            "tensor-parallel layer built without group=: cannot choose the tensor group "
            f"(tp sizes in use: {sizes or 'none'}); pass group=topology.group('tensor') or call "
            "shardspeed.parallel.tensor.groups.topology_for(tp_size) first."
        )
    return live[0].group("tensor")
