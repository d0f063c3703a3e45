"""Topology rank <-> coordinate mapping (pure; no process groups)."""

from __future__ import annotations

import itertools

import pytest

from shardspeed.topology import GROUP_AXES, Coords, Topology
from shardspeed.topology_mpu import mpu_degrees

# (world, pp, dp, tp, ep, sp)
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 1, 2, 1, 1, 1),
    (2, 2, 1, 1, 1, 1),
    (2, 1, 1, 2, 1, 1),
    (2, 1, 1, 1, 1, 2),
    (2, 1, 2, 1, 2, 1),
    (4, 2, 2, 1, 1, 1),
    (4, 1, 2, 2, 1, 1),
    (4, 2, 1, 2, 1, 1),
    (4, 1, 4, 1, 2, 1),
    (4, 1, 4, 1, 4, 1),
    (4, 1, 2, 1, 1, 2),
    (4, 1, 1, 2, 1, 2),
    (6, 1, 3, 2, 1, 1),
    (6, 3, 2, 1, 2, 1),
    (8, 2, 2, 2, 1, 1),
    (8, 2, 2, 2, 2, 1),
    (8, 1, 8, 1, 4, 1),
    (8, 2, 1, 2, 1, 2),
    (8, 1, 2, 2, 2, 2),
    (12, 3, 2, 2, 1, 1),
    (16, 2, 4, 2, 2, 1),
    (16, 2, 2, 2, 2, 2),
    (24, 2, 3, 2, 3, 2),
    (32, 4, 4, 2, 4, 1),
]


def _topo(shape: tuple[int, ...]) -> Topology:
    world, pp, dp, tp, ep, sp = shape
    return Topology(world, pp=pp, dp=dp, tp=tp, sp=sp, ep=ep)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "w{}-pp{}-dp{}-tp{}-ep{}-sp{}".format(*s))
def test_shape_invariants(shape: tuple[int, ...]) -> None:
    world, pp, dp, tp, ep, sp = shape
    topo = _topo(shape)
    assert (topo.world_size, topo.pp, topo.dp, topo.tp, topo.sp, topo.ep) == (
        world,
        pp,
        dp,
        tp,
        sp,
        ep,
    )

    # coords <-> rank round-trip, and the closed-form DeepSpeed grid order
    seen = set()
    for rank in range(world):
        c = topo.coords(rank)
        assert topo.rank_of(pipe=c.pipe, data=c.data, sequence=c.sequence, tensor=c.tensor) == rank
        assert rank == ((c.pipe * dp + c.data) * sp + c.sequence) * tp + c.tensor
        assert c.data == c.expert_data * ep + c.expert
        assert 0 <= c.expert < ep and 0 <= c.expert_data < dp // ep
        seen.add(c)
    assert len(seen) == world
    assert {topo.coords(r)[:4] for r in range(world)} == set(
        itertools.product(range(pp), range(dp), range(sp), range(tp))
    )

    for axis in GROUP_AXES:
        groups = topo.all_axis_groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{axis} groups do not partition the world"
        assert all(len(g) == topo.size(axis) for g in groups)
        for g in groups:
            for member in g:
                assert topo.axis_ranks(axis, member) == g
                assert topo.rank_in(axis, member) == g.index(member)

    # members of a group differ only on the group's axis
    for rank in range(world):
        c = topo.coords(rank)
        for peer in topo.axis_ranks("tensor", rank):
            p = topo.coords(peer)
            assert (p.pipe, p.data, p.sequence) == (c.pipe, c.data, c.sequence)
        for peer in topo.axis_ranks("expert", rank):
            p = topo.coords(peer)
            assert (p.pipe, p.expert_data, p.sequence, p.tensor) == (
                c.pipe, c.expert_data, c.sequence, c.tensor,
            )  # fmt: skip
        for peer in topo.axis_ranks("expert_data", rank):
            assert topo.coords(peer).expert == c.expert

    # tensor peers are adjacent ranks; pipe is the outermost (slowest) axis
    for g in topo.all_axis_groups("tensor"):
        assert g == list(range(g[0], g[0] + tp))
    block = world // pp
    for rank in range(world):
        assert topo.coords(rank).pipe == rank // block
    assert topo.size("data_sequence") == dp * sp
    assert topo.size("model") == pp * tp
    assert topo.size("world") == world


def test_worked_example_world8_pp2_dp2_tp2() -> None:
    topo = Topology(8, pp=2, tp=2)  # dp inferred
    assert topo.dp == 2
    assert topo.coords(5) == Coords(pipe=1, data=0, sequence=0, tensor=1, expert=0, expert_data=0)
    assert topo.all_axis_groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.all_axis_groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.all_axis_groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.all_axis_groups("model") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert topo.stage_rank(1, rank=3) == 7
    assert "rank  pipe" in topo.describe()


def test_expert_groups_are_consecutive_data_indices() -> None:
    topo = Topology(8, dp=8, ep=4)
    assert topo.all_axis_groups("expert") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.all_axis_groups("expert_data") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_sequence_sits_between_data_and_tensor() -> None:
    topo = Topology(8, dp=2, sp=2, tp=2)
    assert topo.all_axis_groups("sequence") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.all_axis_groups("data_sequence") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_stage_flags_use_given_rank() -> None:
    first, last = Topology(4, pp=2, rank=1), Topology(4, pp=2, rank=2)
    assert first.is_first_stage and not first.is_last_stage and first.stage_id == 0
    assert last.is_last_stage and not last.is_first_stage


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (
            {"world_size": 8, "pp": 2, "dp": 3, "tp": 2},
            ["pp*dp*sp*tp = 2*3*1*2 = 12", "world_size is 8"],
        ),
        ({"world_size": 8, "pp": 3}, ["not divisible by pp*sp*tp = 3*1*1 = 3"]),
        ({"world_size": 8, "dp": 4, "tp": 2, "ep": 3}, ["ep=3 must divide dp=4", "[1, 2, 4]"]),
        ({"world_size": 4, "tp": 0}, ["tp=0", "ints >= 1"]),
        ({"world_size": 4, "pp": 1.5}, ["pp=1.5"]),
        ({"world_size": 0}, ["world_size=0"]),
        ({"world_size": 4, "rank": 4}, ["rank=4", "[0, 4)"]),
    ],
)
def test_invalid_layouts_name_every_factor(kwargs: dict, fragments: list[str]) -> None:
    world = kwargs.pop("world_size")
    with pytest.raises(ValueError) as info:
        Topology(world, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_queries() -> None:
    topo = Topology(4, tp=2)
    with pytest.raises(ValueError, match="unknown axis 'mesh'"):
        topo.axis_ranks("mesh", 0)
    with pytest.raises(ValueError, match=r"rank_of\(tensor=2\)"):
        topo.rank_of(tensor=2)
    with pytest.raises(ValueError, match="outside"):
        topo.coords(4)
    with pytest.raises(RuntimeError, match="create_groups"):
        topo.group("data")


def test_create_groups_needs_the_launched_world() -> None:
    with pytest.raises(ValueError, match="needs 4 ranks but torch.distributed has 1"):
        Topology(4, tp=2).create_groups()


# ----------------------------------------------------------------------- from_mpu degrees
class _DegreeMpu:
    """An mpu that reports degrees through whichever method names it is given."""

    def __init__(self, **methods: int) -> None:
        for name, value in methods.items():
            setattr(self, name, lambda value=value: value)

    def get_data_parallel_group(self) -> None:
        return None  # torch's "world"


def test_mpu_degrees_prefer_megatron_names_and_default_to_one() -> None:
    mpu = _DegreeMpu(
        get_data_parallel_world_size=2,
        get_tensor_model_parallel_world_size=2,
        get_model_parallel_world_size=4,  # Megatron's pipe x tensor: not the tensor degree
        get_pipe_parallel_world_size=3,
    )
    pp, dp, sp, tp, sources = mpu_degrees(mpu)
    assert (pp, dp, sp, tp) == (3, 2, 1, 2)
    assert sources["tp"] == "get_tensor_model_parallel_world_size()"
    assert sources["sp"] == "no method, taken as 1"
    only_group = mpu_degrees(_DegreeMpu())  # dp = size of the data group (world of 1 here)
    assert only_group[:4] == (1, 1, 1, 1)
    assert only_group.sources["dp"] == "size of get_data_parallel_group()"


@pytest.mark.parametrize(
    ("methods", "world", "fragments"),
    [
        (
            {
                "get_pipe_parallel_world_size": 2,
                "get_data_parallel_world_size": 3,
                "get_model_parallel_world_size": 2,
            },
            8,
            [
                "pp*dp*sp*tp = 2*3*1*2 = 12 but world_size is 8",
                "pp: get_pipe_parallel_world_size()",
                "sp: no method, taken as 1",
                "tp: get_model_parallel_world_size()",
            ],
        ),
        (
            {"get_data_parallel_world_size": 2, "get_sequence_parallel_world_size": 2},
            2,
            ["pp*dp*sp*tp = 1*2*2*1 = 4 but world_size is 2"],
        ),
        ({"get_data_parallel_world_size": 0}, 4, ["get_data_parallel_world_size() returned 0"]),
    ],
)
def test_from_mpu_degree_errors_name_every_factor(
    methods: dict[str, int], world: int, fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        Topology.from_mpu(_DegreeMpu(**methods), world_size=world)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_from_mpu_needs_a_data_group() -> None:
    class NoGroup:
        pass

    with pytest.raises(ValueError, match="needs get_data_parallel_group"):
        Topology.from_mpu(NoGroup(), world_size=1)
