"""Where tensor-parallel layers get their process group: one cached Topology per tp size.

The tensor axis is a :class:`~shardspeed.topology.Topology` axis like any other (DeepSpeed's
grid, tensor innermost: ranks ``[0, 1]``, ``[2, 3]``, ... at tp=2). Layers built without an
explicit ``group`` and :func:`~shardspeed.parallel.tensor.autotp.tp_model_init` without a
``tp_group`` use :func:`topology_for`, which builds ``Topology.build(tp=tp_size)`` once per
world and tp size; the engine can hand in its own mesh with :func:`register_topology`
(before sharding) or fetch this one, so both sides use the same groups.
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm
from shardspeed.topology import Topology
from shardspeed.utils.reset_hooks import register_reset_hook

# tp_size -> (the world group it was built in, its Topology); a new world invalidates it.
_TOPOLOGIES: dict[int, tuple[Any, Topology]] = {}


@register_reset_hook
def clear_topologies() -> None:
    """Forget every cached Topology (the process groups themselves are not destroyed)."""
    _TOPOLOGIES.clear()


def _cached(tp_size: int) -> Topology | None:
    entry = _TOPOLOGIES.get(tp_size)
    if entry is not None and entry[0] is comm.get_world_group():
        return entry[1]
    return None


def topology_for(tp_size: int) -> Topology:
    """The job's Topology with a tensor axis of ``tp_size`` (built on first use).

    Collective on first use for a given ``tp_size``: every rank must call it (it creates the
    mesh's process groups). ``dp`` is whatever is left: ``world_size // tp_size``.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    topology = _cached(tp_size)
    if topology is not None:
        return topology
    if not comm.is_initialized():
        raise RuntimeError(
            f"topology_for(tp_size={tp_size}) needs torch.distributed; call "
            "shardspeed.init_distributed() first (or launch with torchrun)."
        )
    world_size = comm.get_world_size()
    if world_size % tp_size:
        raise ValueError(
            f"tensor-parallel size {tp_size} does not divide the world size {world_size}; "
            f"choose a tp size among {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )
    topology = Topology.build(tp=tp_size)
    _TOPOLOGIES[tp_size] = (comm.get_world_group(), topology)
    return topology


def register_topology(topology: Topology) -> None:
    """Make ``topology`` (e.g. the engine's pp x dp x tp mesh) the one for its tp size."""
    topology.group("tensor")  # raises if its groups were not created yet
    _TOPOLOGIES[topology.tp] = (comm.get_world_group(), topology)


def tensor_group(tp_size: int) -> Any:
    """The tensor-axis process group of this rank at ``tp_size``."""
    return topology_for(tp_size).group("tensor")


def default_tensor_group() -> Any:
    """The tensor group of the one Topology built or registered in this world.

    For layers constructed without ``group=``: unambiguous only when exactly one tp size > 1
    is in use; otherwise the caller must pass the group.
    """
    live = [
        t for tp, (world, t) in _TOPOLOGIES.items() if tp > 1 and world is comm.get_world_group()
    ]
    if len(live) != 1:
        sizes = sorted(t.tp for t in live)
        raise ValueError(
            "tensor-parallel layer built without group=: cannot choose the tensor group "
            f"(tp sizes in use: {sizes or 'none'}); pass group=topology.group('tensor') or call "
            "shardspeed.parallel.tensor.groups.topology_for(tp_size) first."
        )
    return live[0].group("tensor")
