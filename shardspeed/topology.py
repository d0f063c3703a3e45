"""Topology: the parallel layout of the job, as one device mesh that owns every group.

Ranks are laid out on DeepSpeed's grid, axes ``(pipe, data, sequence, tensor)`` with pipe
outermost and tensor innermost, so tensor-parallel peers are adjacent ranks (one node)::

    rank = ((pipe * dp + data) * sp + sequence) * tp + tensor

Experts are sharded over a sub-axis of data parallelism: ``data = expert_data * ep + expert``
(so an expert-parallel group is ``ep`` consecutive data indices, as DeepSpeed's MoE groups).
The grid is a 5-D :class:`~torch.distributed.device_mesh.DeviceMesh` whose rank tensor is
``arange(world_size)`` reshaped, fine axes outermost first::

    mesh = DeviceMesh(device_type, arange(world_size).reshape(pp, dp // ep, ep, sp, tp),
                      mesh_dim_names=("pipe", "expert_data", "expert", "sequence", "tensor"))

    e.g. world 8, pp=2 dp=2 tp=2:   pipe 0: [[0, 1],    pipe 1: [[4, 5],     <- rows: data
                                              [2, 3]]             [6, 7]]     columns: tensor

Group axes (``fine`` = mesh dims; composite axes are flattened sub-meshes):

=================  =========================  =========================  ===================
axis               mesh dims                  ranks varying along it     used for
=================  =========================  =========================  ===================
``pipe``           pipe                       pipeline stage             stage-to-stage p2p
``data``           expert_data x expert       data index                 gradient all-reduce
                                                                         / ZeRO
``sequence``       sequence                   sequence shard             Ulysses all-to-all
``tensor``         tensor                     tensor shard               TP all-reduce
                                                                         (mpu "model
                                                                         parallel" group)
``expert``         expert                     expert index within a      MoE token
                                              data block                 all-to-all
``expert_data``    expert_data                data blocks holding the    expert-gradient
                                              same experts               all-reduce
``model``          pipe x tensor              ranks jointly holding one  global grad norm
                                              distinct parameter copy
``data_sequence``  expert_data x expert x     data x sequence            what ZeRO shards
                   sequence                                              over when sp > 1
``world``          all five                   everything                 -
=================  =========================  =========================  ===================

The mapping methods are pure (no process groups needed). :meth:`Topology.create_groups`
(or :meth:`Topology.build`, :meth:`Topology.from_mpu`) builds the mesh (device type
``cuda`` on NCCL, ``cpu`` on gloo) in the same order on every rank, as torch requires:
single-axis groups are ``mesh.get_group(axis)``, composite axes come from
``DeviceMesh._flatten`` (or :func:`shardspeed.comm.new_group` where a torch lacks it), an
axis spanning the world is the world group and an axis of size 1 is a singleton group
(never ``None``, which torch would read as "the world"). ``topology.mesh`` and
``topology.submesh(axis)`` hand the mesh to DTensor code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardspeed.comm.node_groups import NodeGroups

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


def _device_mesh_class() -> tuple[type, bool]:
    """``DeviceMesh`` and whether it can flatten dims; a clear error where torch lacks it."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError as exc:
        raise RuntimeError(
            f"Topology needs torch.distributed.device_mesh.DeviceMesh, which this torch "
            f"({torch.__version__}) lacks ({exc}); install torch >= 2.4 built with "
            "distributed support."
        ) from exc
    if not isinstance(DeviceMesh, type) or not hasattr(DeviceMesh, "get_group"):
        raise RuntimeError(
            f"Topology needs torch.distributed.device_mesh.DeviceMesh, but this torch "
            f"({torch.__version__}) has only a stub (torch.distributed is unavailable)."
        )
    return DeviceMesh, hasattr(DeviceMesh, "_flatten")


def _default_backend() -> str:
    import torch.distributed as dist

    return str(dist.get_backend())


def _device_type(backend: str) -> str:
    """The mesh's device type: ``cuda`` when the world talks NCCL, else ``cpu`` (gloo)."""
    return "cuda" if "nccl" in backend else "cpu"


def _group_options(backend: str, timeout: timedelta) -> Any:
    """Backend options carrying ``timeout`` (the one :func:`comm.new_group` would use)."""
    import torch.distributed as dist

    if backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo" and hasattr(dist, "ProcessGroupGloo"):
        options = dist.ProcessGroupGloo._Options()
    else:
        return None  # mixed or third-party backend: torch's default timeout
    options._timeout = timeout
    return options


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
        self._mesh: Any = None
        self._axis_meshes: dict[str, Any] = {}

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

    @classmethod
    def from_config_degrees(
        cls, world_size: int, *, pp: int = 1, tp: int = 1, sp: int = 1, ep: int = 1
    ) -> Topology:
        """The layout for ``world_size`` ranks with these degrees; dp is what is left.

        Pure (no groups): the config's pipeline stages, ``tensor_parallel.autotp_size``,
        ``sequence_parallel_size`` and MoE ``ep_size`` map to ``pp``, ``tp``, ``sp``, ``ep``.
        """
        return cls(world_size, pp=pp, tp=tp, sp=sp, ep=ep)

    @classmethod
    def from_mpu(cls, mpu: Any, world_size: int | None = None, *, ep: int = 1) -> Topology:
        """The layout a Megatron/DeepSpeed-style ``mpu`` reports, with its groups created.

        Reads the degrees from the mpu (a missing method counts as 1; dp defaults to the
        size of ``mpu.get_data_parallel_group()``), checks they multiply to ``world_size``
        (default: the initialised world), then builds the mesh. The mpu's own data (and
        tensor, if it has one) groups are used for those axes, so options it created them
        with (e.g. a timeout) hold; if their members differ from DeepSpeed's grid that is
        logged. Collective: call on every rank. See :mod:`shardspeed.topology_mpu`.
        """
        from shardspeed.topology_mpu import topology_from_mpu

        return topology_from_mpu(cls, mpu, world_size, ep=ep)

    def create_groups(self, *, adopt: Mapping[str, Any] | None = None) -> None:
        """Build the device mesh and every axis group (collective: all ranks, same order).

        ``adopt`` maps an axis (``data``, ``tensor``, ...) to an existing process group
        to hand out for it, and for every other axis with the same mesh dims of size > 1
        (``data_sequence`` when sp == 1, ``expert_data`` when ep == 1; never ``world``),
        instead of the mesh's. The mesh is still built in full.
        """
        from shardspeed import comm

        if comm.get_world_size() != self._world_size:
            raise ValueError(
                f"{self!r} needs {self._world_size} ranks but torch.distributed has "
                f"{comm.get_world_size()}; build the Topology from the launched world size."
            )
        adopt = dict(adopt or {})
        for axis in adopt:
            self._axis_dims(axis)
        self._rank = comm.get_rank()
        mesh_cls, can_flatten = _device_mesh_class()
        backend = _default_backend()
        options = _group_options(backend, comm.get_timeout())
        shape = tuple(self._dims[a] for a in _FINE_AXES)  # (pp, dp // ep, ep, sp, tp)
        # A dim spanning the world gets no options so the mesh reuses the world group.
        overrides = tuple((None, None if n == self._world_size else options) for n in shape)
        mesh = mesh_cls(
            _device_type(backend),
            torch.arange(self._world_size).reshape(shape),  # the DeepSpeed grid
            mesh_dim_names=_FINE_AXES,
            backend_override=overrides,
        )
        groups: dict[str, Any] = {}
        axis_meshes: dict[str, Any] = {}
        for axis in GROUP_AXES:
            sub = self._axis_submesh(mesh, axis, options, can_flatten)
            if sub is not None:
                axis_meshes[axis] = sub
            if self.size(axis) == self._world_size:
                groups[axis] = comm.get_world_group()
            elif sub is not None:
                groups[axis] = sub.get_group()
            else:  # composite axis on a torch without DeviceMesh._flatten
                groups[axis] = self._new_axis_group(axis)
        for adopted_axis, group in adopt.items():  # and every axis with the same members
            for axis in GROUP_AXES:
                if axis != "world" and self._varying(axis) == self._varying(adopted_axis):
                    groups[axis] = group
        self._mesh, self._axis_meshes, self._groups = mesh, axis_meshes, groups
        logger.debug("built %r on %s (adopted axes: %s)", mesh, self, sorted(adopt) or "none")

    def _varying(self, axis: str) -> tuple[str, ...]:
        """The mesh dims of size > 1 along ``axis`` (its innermost dim if none)."""
        dims = GROUP_AXES[axis]
        return tuple(a for a in dims if self._dims[a] > 1) or dims[-1:]

    def _axis_submesh(self, mesh: Any, axis: str, options: Any, can_flatten: bool) -> Any:
        """The 1-D mesh along ``axis``: a mesh dim, or its dims of size > 1 flattened."""
        varying = self._varying(axis)
        if len(varying) == 1:  # the others have size 1: same members as this dim
            return mesh[varying[0]]
        if not can_flatten:
            return None
        spans_world = self.size(axis) == self._world_size
        return mesh[varying]._flatten(axis, backend_override=None if spans_world else options)

    def _new_axis_group(self, axis: str) -> Any:
        from shardspeed import comm

        mine = None
        for ranks in self.all_axis_groups(axis):  # same order on every rank
            group = comm.new_group(ranks)
            if self._rank in ranks:
                mine = group
        return mine

    def group(self, axis: str) -> Any:
        """This rank's process group along ``axis`` (after :meth:`create_groups`)."""
        self._axis_dims(axis)
        return self._require_groups()[axis]

    def _require_groups(self) -> dict[str, Any]:
        if self._groups is None:
            raise RuntimeError(
                f"{self!r} has no process groups yet; call topology.create_groups() on every "
                "rank (or construct it with Topology.build(...))."
            )
        return self._groups

    @property
    def mesh(self) -> DeviceMesh:
        """The 5-D device mesh (pipe, expert_data, expert, sequence, tensor)."""
        self._require_groups()
        return self._mesh

    def submesh(self, axis: str) -> DeviceMesh:
        """This rank's 1-D device mesh along ``axis`` (for DTensor placements).

        Fine axes are mesh dims; a composite axis (``data``, ``model``, ...) is its
        flattened mesh. An adopted group (see :meth:`from_mpu`) is not in the mesh: its
        sub-mesh follows the DeepSpeed grid.
        """
        self._axis_dims(axis)
        self._require_groups()
        if axis not in self._axis_meshes:
            raise RuntimeError(
                f"submesh({axis!r}): this torch {torch.__version__} has no "
                "DeviceMesh._flatten, so composite axes have plain process groups only; use "
                f"topology.group({axis!r}) or a fine axis {list(_FINE_AXES)}."
            )
        return self._axis_meshes[axis]

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

    # ----------------------------------------------------------------- hosts
    def node_groups(self) -> NodeGroups:
        """Which ranks share a host, with this rank's intra- and inter-host process groups.

        Collective on the first call (one ``all_gather_object`` of host keys, then the
        groups; every rank, same order); cached. Independent of the mesh axes: compare with
        ``node_groups().layout.spans_hosts(topology.axis_ranks("tensor"))``. See
        :mod:`shardspeed.comm.node_groups` for how hosts are told apart.
        """
        from shardspeed import comm
        from shardspeed.comm.node_groups import NodeGroups

        cached = getattr(self, "_node_groups", None)
        if cached is None:
            if comm.get_world_size() != self._world_size:
                raise ValueError(
                    f"{self!r} needs {self._world_size} ranks but torch.distributed has "
                    f"{comm.get_world_size()}; build the Topology from the launched world size."
                )
            cached = self._node_groups = NodeGroups.build()
        return cached
