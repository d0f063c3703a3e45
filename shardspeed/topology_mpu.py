"""Building a :class:`~shardspeed.topology.Topology` from a Megatron/DeepSpeed-style mpu.

An ``mpu`` ("model-parallel unit") is the object Megatron-LM and DeepSpeed scripts pass to
``initialize(mpu=...)``. Its degrees are read with the first method it has on each row
(a missing row counts as 1; a missing data-parallel size is the size of its data group):

====  ==============================================================================
axis  mpu methods, in order of preference
====  ==============================================================================
pp    ``get_pipeline_model_parallel_world_size``, ``get_pipe_parallel_world_size``
dp    ``get_data_parallel_world_size`` (else the size of ``get_data_parallel_group()``)
sp    ``get_sequence_parallel_world_size``
tp    ``get_tensor_model_parallel_world_size``, ``get_model_parallel_world_size``
====  ==============================================================================

The mpu's groups are then compared with DeepSpeed's grid (tensor innermost). Either way
the mesh is built in full and the mpu's own data group (and tensor group, if it has
``get_tensor_model_parallel_group``, or ``get_model_parallel_group`` when pp == 1) is what
``topology.group("data")`` / ``group("tensor")`` return, and the axes with the same members
(``data_sequence`` when sp == 1, ...), so its creation options (a timeout) hold. A layout
other than the grid is logged: the other axes then follow the grid, not the mpu.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, TypeVar

from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)


class _Mesh(Protocol):
    """What :func:`topology_from_mpu` uses of :class:`~shardspeed.topology.Topology`.

    Structural, so this module never imports ``shardspeed.topology`` (which imports it).
    """

    def axis_ranks(self, axis: str, rank: int | None = None) -> list[int]: ...

    def create_groups(self, *, adopt: Mapping[str, Any] | None = None) -> None: ...


_MeshT = TypeVar("_MeshT", bound=_Mesh)

_DEGREE_METHODS: dict[str, tuple[str, ...]] = {
    "pp": ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"),
    "dp": ("get_data_parallel_world_size",),
    "sp": ("get_sequence_parallel_world_size",),
    "tp": ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"),
}


class MpuDegrees(NamedTuple):
    """The degrees an mpu reports, and where each came from (for error messages)."""

    pp: int
    dp: int
    sp: int
    tp: int
    sources: dict[str, str]


def _first_method(mpu: Any, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if callable(getattr(mpu, n, None))), None)


def mpu_degrees(mpu: Any) -> MpuDegrees:
    """Read ``pp, dp, sp, tp`` from ``mpu`` (pure unless dp must come from its group)."""
    values: dict[str, int] = {}
    sources: dict[str, str] = {}
    for axis, names in _DEGREE_METHODS.items():
        method = _first_method(mpu, names)
        if method is not None:
            value, sources[axis] = getattr(mpu, method)(), f"{method}()"
        elif axis == "dp":
            if not callable(getattr(mpu, "get_data_parallel_group", None)):
                raise ValueError(
                    f"initialize(mpu={type(mpu).__name__}): an mpu needs "
                    "get_data_parallel_group() (and ideally get_data_parallel_world_size()); "
                    "pass a Megatron/DeepSpeed-style mpu or leave mpu=None."
                )
            value = len(group_ranks(mpu.get_data_parallel_group()))
            sources[axis] = "size of get_data_parallel_group()"
        else:
            value, sources[axis] = 1, "no method, taken as 1"
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"mpu.{sources[axis]} returned {value!r}; a parallel degree must be an int >= 1."
            )
        values[axis] = value
    return MpuDegrees(values["pp"], values["dp"], values["sp"], values["tp"], sources)


def check_mpu_degrees(degrees: MpuDegrees, world_size: int) -> None:
    """Raise a ValueError naming every factor unless ``pp*dp*sp*tp == world_size``."""
    pp, dp, sp, tp, sources = degrees
    if pp * dp * sp * tp != world_size:
        where = "; ".join(f"{axis}: {src}" for axis, src in sources.items())
        raise ValueError(
            f"Topology.from_mpu: pp*dp*sp*tp = {pp}*{dp}*{sp}*{tp} = {pp * dp * sp * tp} but "
            f"world_size is {world_size} ({where}); the mpu's degrees must multiply to the "
            "number of ranks: pass the mpu that built this world's groups."
        )


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group``, ascending (``None`` is the world, as in torch)."""
    from shardspeed import comm

    if group is None or group is comm.get_world_group():
        return list(range(comm.get_world_size()))
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group))


def _mpu_groups(mpu: Any, pp: int) -> dict[str, Any]:
    """The mpu's own groups for the axes it defines: data, and tensor when unambiguous."""
    groups = {"data": mpu.get_data_parallel_group()}
    tensor = _first_method(mpu, ("get_tensor_model_parallel_group",))
    if tensor is None and pp == 1:  # Megatron's "model" group is pipe x tensor
        tensor = _first_method(mpu, ("get_model_parallel_group",))
    if tensor is not None:
        groups["tensor"] = getattr(mpu, tensor)()
    return {axis: g for axis, g in groups.items() if g is not None}  # None: "the world"


def topology_from_mpu(
    cls: Callable[..., _MeshT], mpu: Any, world_size: int | None, *, ep: int = 1
) -> _MeshT:
    """:meth:`Topology.from_mpu`: validate the mpu's degrees, build the mesh, adopt groups."""
    from shardspeed import comm

    world_size = comm.get_world_size() if world_size is None else world_size
    degrees = mpu_degrees(mpu)
    check_mpu_degrees(degrees, world_size)
    topo = cls(world_size, pp=degrees.pp, dp=degrees.dp, tp=degrees.tp, sp=degrees.sp, ep=ep)
    adopted = _mpu_groups(mpu, degrees.pp)
    rank = comm.get_rank()
    members = {axis: (group_ranks(g), topo.axis_ranks(axis, rank)) for axis, g in adopted.items()}
    differs = {axis: pair for axis, pair in members.items() if pair[0] != pair[1]}
    topo.create_groups(adopt=adopted)
    if differs:
        shown = "; ".join(f"{a}: mpu {m} vs grid {g}" for a, (m, g) in differs.items())
        log_dist(
            f"Topology.from_mpu: the mpu's groups differ from DeepSpeed's grid on rank "
            f"{rank} ({shown}); using the mpu's {sorted(adopted)} groups, the other axes "
            f"(pipe, sequence, expert, composites, the mesh) follow the grid of {topo!r}.",
            ranks=[-1],
            name=__name__,
        )
    else:
        logger.debug("mpu groups match the DeepSpeed grid of %r", topo)
    return topo
