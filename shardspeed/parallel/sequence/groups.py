"""Where Ulysses attention gets its process group: one cached Topology per sequence-parallel size.

The sequence axis is a :class:`~shardspeed.topology.Topology` axis like any other. On
DeepSpeed's grid (tensor innermost, then sequence) the ranks of one sequence group are
adjacent: at sp=2 on 4 ranks the groups are ``[0, 1]`` and ``[2, 3]``, and the data axis
pairs ``[0, 2]``, ``[1, 3]``. :func:`topology_for` builds ``Topology.build(sp=sp_size)``
once per world and sp size; the engine can hand in its own mesh (pp x dp x sp x tp) with
:func:`register_topology`, so user code calling :func:`sequence_group` and the engine's
gradient reduction see the same groups.
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm
from shardspeed.topology import Topology
from shardspeed.utils.reset_hooks import register_reset_hook

# sp_size -> (the world group it was built in, its Topology); a new world invalidates it.
_TOPOLOGIES: dict[int, tuple[Any, Topology]] = {}


@register_reset_hook
def clear_topologies() -> None:
    """Forget every cached Topology (the process groups themselves are not destroyed)."""
    _TOPOLOGIES.clear()


def _cached(sp_size: int) -> Topology | None:
    entry = _TOPOLOGIES.get(sp_size)
    if entry is not None and entry[0] is comm.get_world_group():
        return entry[1]
    return None


def topology_for(sp_size: int) -> Topology:
    """The job's Topology with a sequence axis of ``sp_size`` (built on first use).

    Collective on first use for a given ``sp_size``: every rank must call it (it creates the
    mesh's process groups). ``dp`` is whatever is left: ``world_size // sp_size``.
    """
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be an int >= 1, got {sp_size!r}")
    topology = _cached(sp_size)
    if topology is not None:
        return topology
    if not comm.is_initialized():
        raise RuntimeError(
            f"topology_for(sp_size={sp_size}) needs torch.distributed; call "
            "shardspeed.init_distributed() first (or launch with torchrun)."
        )
    world_size = comm.get_world_size()
    if world_size % sp_size:
        raise ValueError(
            f"sequence-parallel size {sp_size} does not divide the world size {world_size}; "
            f"choose an sp size among {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )
    topology = Topology.build(sp=sp_size)
    _TOPOLOGIES[sp_size] = (comm.get_world_group(), topology)
    return topology


def register_topology(topology: Topology) -> None:
    """Make ``topology`` (e.g. the engine's mesh) the one for its sequence-parallel size."""
    topology.group("sequence")  # raises if its groups were not created yet
    _TOPOLOGIES[topology.sp] = (comm.get_world_group(), topology)


def sequence_group(sp_size: int) -> Any:
    """The sequence-axis process group of this rank at ``sp_size``."""
    return topology_for(sp_size).group("sequence")
