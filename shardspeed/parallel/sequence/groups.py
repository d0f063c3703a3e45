"""Where Ulysses attention gets its process group: one cached Topology per sequence-parallel size.

The sequence axis is a :class:`~shardspeed.topology.Topology` axis like any other. On
DeepSpeed's grid (tensor innermost, then sequence) the ranks of one sequence group are
adjacent: at sp=2 on 4 ranks the groups are ``[0, 1]`` and ``[2, 3]``, and the data axis
pairs ``[0, 2]``, ``[1, 3]``. :func:`topology_for` builds ``Topology.build(sp=sp_size)``
once per world and sp size (kept in :data:`~shardspeed.parallel.topology_cache.TOPOLOGIES`); the engine can hand in its own mesh (pp x dp x sp x tp) with
:func:`register_topology`, so user code calling :func:`sequence_group` and the engine's
gradient reduction see the same groups.
"""

from __future__ import annotations

from typing import Any

from shardspeed.parallel.topology_cache import TOPOLOGIES
from shardspeed.topology import Topology


def register_topology(topology: Topology) -> None:
    """Make ``topology`` (e.g. the engine's mesh) the one for its sequence degree."""
    TOPOLOGIES.register(topology, "sequence")


def topology_for(sp_size: int) -> Topology:
    """The job's Topology with a sequence axis of ``sp_size`` (built on first use; collective)."""
    return TOPOLOGIES.axis_topology("sequence", sp_size)


def sequence_group(sp_size: int) -> Any:
    """The sequence-axis process group of this rank at ``sp_size``."""
    return topology_for(sp_size).group("sequence")
