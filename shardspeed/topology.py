"""Topology: the parallel layout of the job and every process group it needs.

Ranks are laid out on DeepSpeed's grid, axes ``(pipe, data, sequence, tensor)`` with pipe
outermost and tensor innermost, so tensor-parallel peers are adjacent ranks (one node)::

    rank = ((pipe * dp + data) * sp + sequence) * tp + tensor

Experts are sharded over a sub-axis of data parallelism: ``data = expert_data * ep + expert``
(so an expert-parallel group is ``ep`` consecutive data indices). Group axes:

=================  =========================================  ==========================
axis               ranks varying along it                     used for
=================  =========================================  ==========================
``pipe``           pipeline stage                             stage-to-stage p2p
``data``           data index (``expert_data x expert``)       gradient all-reduce / ZeRO
``sequence``       sequence shard                             Ulysses all-to-all
``tensor``         tensor shard                               TP all-reduce (DeepSpeed mpu
                                                              "model parallel" group)
``expert``         expert index within a data block            MoE token all-to-all
``expert_data``    data blocks holding the same experts        expert-gradient all-reduce
``model``          pipe x tensor                               ranks jointly holding one
                                                              distinct copy of the
                                                              parameters (global grad norm)
``data_sequence``  data x sequence                             what ZeRO shards over when
                                                              sp > 1 (params replicated)
``world``          everything                                 -
=================  =========================================  ==========================

The mapping methods are pure (no process groups needed). :meth:`Topology.create_groups`
(or :meth:`Topology.build`) makes every group with :func:`shardspeed.comm.new_group`, in
the same order on every rank as torch requires; an axis spanning the world reuses the
world group and an axis of size 1 gets a singleton group (never ``None``, which torch
would read as "the world").
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

# Fine-grained axes, outermost first; "data" is (expert_data, expert).
_FINE_AXES = ("pipe", "expert_data", "expert", "sequence", "tensor")
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "pipe": ("pipe",),
    "data": ("expert_data", "expert"),
    "sequence": ("sequence",),
    "tensor": ("tensor",),
    "expert": ("expert",),
    "expert_data": ("expert_data",),
    "model": ("pipe", "tensor"),
    "data_sequence": ("expert_data", "expert", "sequence"),
    "world": _FINE_AXES,
}


class Coords(NamedTuple):
    """Coordinates of one rank on every axis."""

    pipe: int
    data: int
    sequence: int
    tensor: int
    expert: int
    expert_data: int


def _check_degree(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Topology({name}={value!r}): parallel degrees must be ints >= 1 (use 1 to "
            "disable that kind of parallelism)."
        )
    return value


class Topology:
    """Rank <-> coordinate map for ``world_size = pp * dp * sp * tp`` and its groups.

    ``dp=None`` means "whatever is left": ``world_size // (pp * sp * tp)``. ``ep`` must
    divide ``dp``. ``rank`` defaults to this process's rank once groups are created (or 0).
    """

    def __init__(
        self,
        world_size: int,
        *,
        pp: int = 1,
        dp: int | None = None,
        tp: int = 1,
        sp: int = 1,
        ep: int = 1,
        rank: int | None = None,
    ) -> None:
        world_size = _check_degree("world_size", world_size)
        pp, tp, sp, ep = (
            _check_degree(n, v) for n, v in (("pp", pp), ("tp", tp), ("sp", sp), ("ep", ep))
        )
        if dp is None:
            model = pp * sp * tp
            if world_size % model:
                raise ValueError(
                    f"Topology: world_size {world_size} is not divisible by pp*sp*tp = "
                    f"{pp}*{sp}*{tp} = {model}, so dp cannot be inferred; choose degrees whose "
                    f"product divides the number of ranks."
                )
            dp = world_size // model
        dp = _check_degree("dp", dp)
        if pp * dp * sp * tp != world_size:
            raise ValueError(
                f"Topology: pp*dp*sp*tp = {pp}*{dp}*{sp}*{tp} = {pp * dp * sp * tp} but "
                f"world_size is {world_size}; the degrees must multiply to the number of "
                "ranks (pass dp=None to infer it)."
            )
        if dp % ep:
            raise ValueError(
                f"Topology: ep={ep} must divide dp={dp} (experts are sharded over a sub-axis "
                f"of data parallelism); valid ep values: "
                f"{[d for d in range(1, dp + 1) if dp % d == 0]}."
            )
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"Topology(rank={rank}) must be in [0, {world_size}).")
        self._world_size, self._pp, self._dp, self._tp, self._sp, self._ep = (
            world_size, pp, dp, tp, sp, ep,
        )  # fmt: skip
        self._dims = {
            "pipe": pp,
            "expert_data": dp // ep,
            "expert": ep,
            "sequence": sp,
            "tensor": tp,
        }
        self._rank = rank
        self._groups: dict[str, Any] | None = None

    # ----------------------------------------------------------------- degrees
    world_size = property(lambda self: self._world_size, doc="Number of ranks.")
    pp = property(lambda self: self._pp, doc="Pipeline-parallel degree.")
    dp = property(lambda self: self._dp, doc="Data-parallel degree (includes ep).")
    tp = property(lambda self: self._tp, doc="Tensor-parallel degree.")
    sp = property(lambda self: self._sp, doc="Sequence-parallel degree.")
    ep = property(lambda self: self._ep, doc="Expert-parallel degree (divides dp).")

    @property
    def rank(self) -> int:
        """This process's global rank (given, or from torch.distributed, else 0)."""
        if self._rank is not None:
            return self._rank
        from shardspeed import comm

        return comm.get_rank()

    def __repr__(self) -> str:
        return (
            f"Topology(world_size={self._world_size}, pp={self._pp}, dp={self._dp}, "
            f"sp={self._sp}, tp={self._tp}, ep={self._ep})"
        )

    # ----------------------------------------------------------------- pure mapping
    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or not 0 <= rank < self._world_size:
            raise ValueError(f"rank {rank!r} is outside [0, {self._world_size}) for {self!r}")
        return rank

    def _fine(self, rank: int) -> dict[str, int]:
        coords: dict[str, int] = {}
        for axis in reversed(_FINE_AXES):  # innermost first
            rank, coords[axis] = divmod(rank, self._dims[axis])
        return coords

    def _rank_of_fine(self, fine: dict[str, int]) -> int:
        rank = 0
        for axis in _FINE_AXES:
            rank = rank * self._dims[axis] + fine[axis]
        return rank

    def coords(self, rank: int) -> Coords:
        """Coordinates of ``rank`` on every axis."""
        f = self._fine(self._check_rank(rank))
        data = f["expert_data"] * self._ep + f["expert"]
        return Coords(f["pipe"], data, f["sequence"], f["tensor"], f["expert"], f["expert_data"])

    def rank_of(self, *, pipe: int = 0, data: int = 0, sequence: int = 0, tensor: int = 0) -> int:
        """Global rank at the given coordinates (omitted axes are 0)."""
        given = {
            "pipe": (pipe, self._pp),
            "data": (data, self._dp),
            "sequence": (sequence, self._sp),
            "tensor": (tensor, self._tp),
        }
        for name, (value, size) in given.items():
            if not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"rank_of({name}={value!r}) must be in [0, {size}) for {self!r}")
        return ((pipe * self._dp + data) * self._sp + sequence) * self._tp + tensor

    def _axis_dims(self, axis: str) -> tuple[str, ...]:
        if axis not in GROUP_AXES:
            raise ValueError(f"unknown axis {axis!r}; valid axes: {list(GROUP_AXES)}")
        return GROUP_AXES[axis]

    def size(self, axis: str) -> int:
        """Number of ranks in one group along ``axis``."""
        return math.prod(self._dims[a] for a in self._axis_dims(axis))

    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """The group along ``axis`` containing ``rank`` (default: this rank), ascending."""
        varying = self._axis_dims(axis)
        base = self._fine(self._check_rank(self.rank if rank is None else rank))
        ranges = [range(self._dims[a]) for a in varying]
        ranks = []
        for values in itertools.product(*ranges):
            base.update(zip(varying, values))
            ranks.append(self._rank_of_fine(base))
        return sorted(ranks)

    def all_axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (a partition of the world), ordered by first rank."""
        seen: set[int] = set()
        groups = []
        for rank in range(self._world_size):
            if rank not in seen:
                group = self.axis_ranks(axis, rank)
                seen.update(group)
                groups.append(group)
        return groups

    def rank_in(self, axis: str, rank: int | None = None) -> int:
        """Index of ``rank`` (default: this rank) within its group along ``axis``."""
        rank = self.rank if rank is None else rank
        return self.axis_ranks(axis, rank).index(rank)

    # ----------------------------------------------------------------- pipeline helpers
    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.coords(self.rank).pipe

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self._pp - 1

    def stage_rank(self, stage: int, rank: int | None = None) -> int:
        """The rank of pipeline ``stage`` that shares every other coordinate with ``rank``."""
        c = self.coords(self.rank if rank is None else rank)
        return self.rank_of(pipe=stage, data=c.data, sequence=c.sequence, tensor=c.tensor)

    # ----------------------------------------------------------------- process groups
    @classmethod
    def build(
        cls,
        world_size: int | None = None,
        *,
        pp: int = 1,
        dp: int | None = None,
        tp: int = 1,
        sp: int = 1,
        ep: int = 1,
    ) -> Topology:
        """Make a Topology for the initialised world (default size) and create its groups."""
        from shardspeed import comm

        topo = cls(
            comm.get_world_size() if world_size is None else world_size,
            pp=pp,
            dp=dp,
            tp=tp,
            sp=sp,
            ep=ep,
        )
        topo.create_groups()
        return topo

    def create_groups(self) -> None:
        """Create every group on every axis (collective: call on all ranks, same order)."""
        from shardspeed import comm

        if comm.get_world_size() != self._world_size:
            raise ValueError(
                f"{self!r} needs {self._world_size} ranks but torch.distributed has "
                f"{comm.get_world_size()}; build the Topology from the launched world size."
            )
        self._rank = comm.get_rank()
        made: dict[tuple[int, ...], Any] = {}
        mine: dict[str, Any] = {}
        for axis in GROUP_AXES:
            for ranks in self.all_axis_groups(axis):
                key = tuple(ranks)
                if key not in made:
                    if len(ranks) == self._world_size:
                        made[key] = comm.get_world_group()
                    else:
                        made[key] = comm.new_group(ranks)
                if self._rank in ranks:
                    mine[axis] = made[key]
        self._groups = mine
        logger.debug("created process groups for %r (%d distinct)", self, len(made))

    def group(self, axis: str) -> Any:
        """This rank's process group along ``axis`` (after :meth:`create_groups`)."""
        self._axis_dims(axis)
        if self._groups is None:
            raise RuntimeError(
                f"{self!r} has no process groups yet; call topology.create_groups() on every "
                "rank (or construct it with Topology.build(...))."
            )
        return self._groups[axis]

    def describe(self) -> str:
        """A table of every rank's coordinates (for logs and docs)."""
        rows = [
            f"{'rank':>4}  {'pipe':>4}  {'data':>4}  {'seq':>4}  {'tensor':>6}  {'expert':>6}  {'exp_data':>8}"
        ]
        for r in range(self._world_size):
            c = self.coords(r)
            rows.append(
                f"{r:>4}  {c.pipe:>4}  {c.data:>4}  {c.sequence:>4}  {c.tensor:>6}  {c.expert:>6}  {c.expert_data:>8}"
            )
        return "\n".join(rows)
