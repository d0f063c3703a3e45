"""The job's cached Topologies: one :class:`TopologyCache`, :data:`TOPOLOGIES`, per process.

Several parts find their process groups without being handed a Topology:

=====================================  ==================================================
who                                    asks for
=====================================  ==================================================
tensor-parallel layers, AutoTP         the Topology whose ``tensor`` axis has tp ranks
Ulysses attention                      the Topology whose ``sequence`` axis has sp ranks
MoE layers, expert checkpoints         the Topology whose ``expert`` axis has ep ranks
``shardspeed.initialize``              the job's mesh for (tp, sp), reused by later engines
``deepspeed.utils.groups``             the job's mesh the last ``initialize`` used
=====================================  ==================================================

All of it lives here, in one object, for as long as the world process group it was built
in: a Topology holds its process groups (and, on gloo, their threads), and those groups die
with their world. So the first use after ``destroy_process_group()`` and a new
``init_process_group()`` finds a different world group and drops every entry first (a
stale Topology would hand out destroyed groups and keep their threads alive), and the warm
workers of :func:`shardspeed.testing.run_distributed` clear it between calls (a reset hook).
Clearing forgets the Topologies; destroying their groups is torch's ``destroy_process_group``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardspeed import comm
from shardspeed.topology import Topology
from shardspeed.utils.reset_hooks import register_reset_hook

# axis -> (Topology.build keyword for its degree, what the error messages call it)
_AXIS_DEGREES = {
    "tensor": ("tp", "tensor-parallel"),
    "sequence": ("sp", "sequence-parallel"),
    "expert": ("ep", "expert-parallel"),
}


class TopologyCache:
    """The Topologies built (or handed in) in the current world, by what they serve."""

    def __init__(self) -> None:
        self._world: Any = None  # the world group the entries were built in
        self._by_axis: dict[tuple[str, int], Topology] = {}  # (axis, degree) -> Topology
        self._by_layout: dict[tuple[int, int], Topology] = {}  # initialize's (tp, sp) -> mesh
        self._job: Topology | None = None  # the mesh the last initialize used

    def clear(self) -> None:
        """Forget every Topology (their process groups are not destroyed here)."""
        self._world, self._job = None, None
        self._by_axis.clear()
        self._by_layout.clear()

    def _in_current_world(self) -> None:
        """Drop the entries of a world that is gone (destroyed, or replaced by a new init)."""
        world = comm.get_world_group() if comm.is_initialized() else None
        if world is not self._world:
            self.clear()
            self._world = world

    # ----------------------------------------------------------------- one axis at a time
    def axis_topology(self, axis: str, size: int) -> Topology:
        """The Topology whose ``axis`` has ``size`` ranks (``dp`` is what is left).

        Built with ``Topology.build`` on first use for a size (collective: every rank must
        call it, in the same order), unless one was :meth:`register`-ed for it.
        """
        degree, label = _AXIS_DEGREES[axis]
        name = f"{degree}_size"
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
        self._in_current_world()
        topology = self._by_axis.get((axis, size))
        if topology is not None:
            return topology
        if not comm.is_initialized():
            raise RuntimeError(
                f"topology_for({name}={size}) needs torch.distributed; call "
                "shardspeed.init_distributed() first (or launch with torchrun)."
            )
        world_size = comm.get_world_size()
        if world_size % size:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"{label} size {size} does not divide the world size {world_size}; choose a "
                f"size among {divisors}."
            )
        topology = self._by_axis[(axis, size)] = Topology.build(**{degree: size})
        return topology

    def register(self, topology: Topology, axis: str) -> None:
        """Make ``topology`` (e.g. the engine's mesh) the one for its degree along ``axis``."""
        if axis not in _AXIS_DEGREES:
            raise ValueError(f"register(axis={axis!r}): expected one of {sorted(_AXIS_DEGREES)}")
        topology.group(axis)  # raises if its groups were not created yet
        self._in_current_world()
        self._by_axis[(axis, topology.size(axis))] = topology

    def live(self, axis: str) -> list[Topology]:
        """The Topologies with more than one rank along ``axis`` in the current world."""
        self._in_current_world()
        return [t for (a, size), t in self._by_axis.items() if a == axis and size > 1]

    # ----------------------------------------------------------------- the job's mesh
    def job_topology(self, tp: int, sp: int, build: Callable[[], Topology]) -> Topology:
        """The job's mesh for ``tp`` x ``sp`` (``build()`` on first use); it becomes :meth:`job`."""
        self._in_current_world()
        topology = self._by_layout.get((tp, sp))
        if topology is None:
            topology = self._by_layout[(tp, sp)] = build()
        self._job = topology
        return topology

    def set_job(self, topology: Topology) -> None:
        """Record ``topology`` (e.g. one built from an mpu) as the job's mesh."""
        self._in_current_world()
        self._job = topology

    def job(self) -> Topology | None:
        """The mesh the last ``shardspeed.initialize`` in this world used, if any."""
        self._in_current_world()
        return self._job


# The one instance. Its lifetime is the world group's (see the module docstring).
TOPOLOGIES = TopologyCache()
register_reset_hook(TOPOLOGIES.clear)
