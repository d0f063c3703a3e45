"""One cached :class:`~shardspeed.topology.Topology` per parallel degree of one axis.

Tensor- and sequence-parallel layers find their process group without being handed one:
``TopologyCache("tensor", "tp")`` builds ``Topology.build(tp=n)`` once per world and degree
(a new world invalidates it), and the engine can hand in its own mesh with
:meth:`TopologyCache.register` so the layers and the engine share the same groups.
"""

from __future__ import annotations

from typing import Any

from shardspeed import comm
from shardspeed.topology import Topology
from shardspeed.utils.reset_hooks import register_reset_hook


class TopologyCache:
    """Topologies by degree along ``axis`` (``degree`` is ``Topology.build``'s keyword)."""

    def __init__(self, axis: str, degree: str, label: str) -> None:
        self.axis, self.degree, self.label = axis, degree, label
        # degree -> (the world group it was built in, its Topology)
        self.entries: dict[int, tuple[Any, Topology]] = {}
        register_reset_hook(self.clear)

    def clear(self) -> None:
        """Forget every cached Topology (the process groups themselves are not destroyed)."""
        self.entries.clear()

    def live(self) -> list[Topology]:
        """Topologies of degree > 1 built or registered in the current world."""
        world = comm.get_world_group()
        return [t for n, (w, t) in self.entries.items() if n > 1 and w is world]

    def topology_for(self, size: int) -> Topology:
        """The job's Topology with an ``axis`` of ``size`` ranks (built on first use).

        Collective on first use for a given size: every rank must call it (it creates the
        mesh's process groups). ``dp`` is whatever is left: ``world_size // size``.
        """
        name = f"{self.degree}_size"
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an int >= 1, got {size!r}")
        entry = self.entries.get(size)
        if entry is not None and entry[0] is comm.get_world_group():
            return entry[1]
        if not comm.is_initialized():
            raise RuntimeError(
                f"topology_for({name}={size}) needs torch.distributed; call "
                "shardspeed.init_distributed() first (or launch with torchrun)."
            )
        world_size = comm.get_world_size()
        if world_size % size:
            raise ValueError(
                f"{self.label} size {size} does not divide the world size {world_size}; "
                f"choose a size among {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
            )
        topology = Topology.build(**{self.degree: size})
        self.entries[size] = (comm.get_world_group(), topology)
        return topology

    def register(self, topology: Topology) -> None:
        """Make ``topology`` (e.g. the engine's mesh) the one for its degree along ``axis``."""
        topology.group(self.axis)  # raises if its groups were not created yet
        self.entries[topology.size(self.axis)] = (comm.get_world_group(), topology)
