"""DeepSpeed's pipeline topology classes, as thin views of :class:`shardspeed.topology.Topology`.

``ProcessTopology(axes, dims)`` maps ranks to coordinates on named axes (last axis
fastest); ``PipeDataParallelTopology(num_pp, num_dp)`` and
``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` are the two layouts DeepSpeed
users pass to ``PipelineModule(topology=...)``. Both use axes ``pipe, data[, model]``,
which is exactly our :class:`~shardspeed.topology.Topology` grid (pipe outermost, tensor
innermost), so :meth:`ProcessTopology.to_topology` gives the object that owns the groups.
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from typing import Any

from shardspeed.topology import Topology

# DeepSpeed axis name -> Topology keyword
_AXIS_TO_TOPOLOGY = {"pipe": "pp", "data": "dp", "model": "tp", "tensor": "tp"}


class ProcessTopology:
    """Rank <-> coordinate mapping over named ``axes`` of sizes ``dims`` (row-major)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(
                f"ProcessTopology(axes={axes!r}, dims={dims!r}): axes must be distinct names, "
                "one per entry of dims."
            )
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
            raise ValueError(f"ProcessTopology(dims={dims!r}): every dim must be an int >= 1.")
        self.axes = list(axes)
        self.dims = list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping = {
            self.ProcessCoord(*coord): rank
            for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims)))
        }

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis`` (0 when the axis does not exist, like DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at the given coordinates (every axis must be named)."""
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank needs every axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank({coord_kwargs}) is outside dims {self.dims}")
        return self.mapping[key]

    def get_coord(self, rank: int) -> Any:
        """The coordinates (a named tuple) of ``rank``."""
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is outside [0, {self.world_size()})")

    def get_rank_repr(
        self, rank: int, omit_axes: tuple[str, ...] = ("data", "pipe"), inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:  # fmt: skip
        coord = self.get_coord(rank)
        parts = [f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes]
        return outer_sep.join(parts)

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every given ``axis=value``."""
        return sorted(
            r
            for c, r in self.mapping.items()
            if all(getattr(c, a) == v for a, v in filter_kwargs.items())
        )

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx}) if axis in self.axes else []

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only on ``axis``."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def to_topology(self, rank: int | None = None) -> Topology:
        """The equivalent :class:`Topology` (axes must be ``pipe, data[, model|tensor]``)."""
        canonical = [a for a in ("pipe", "data", "model", "tensor") if a in self.axes]
        unknown = [a for a in self.axes if a not in _AXIS_TO_TOPOLOGY]
        if unknown or self.axes != canonical:
            raise ValueError(
                f"ProcessTopology axes {self.axes} cannot be mapped onto the ShardSpeed grid; "
                "use the order ['pipe', 'data', 'model'] (any subset, in that order)."
            )
        degrees = {_AXIS_TO_TOPOLOGY[a]: d for a, d in zip(self.axes, self.dims)}
        return Topology(self.world_size(), rank=rank, **degrees)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: ``num_pp`` stages, each replicated ``num_dp`` times."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism, model innermost."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
