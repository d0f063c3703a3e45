"""Topology's device mesh on 4 and 8 gloo ranks: every axis group has DeepSpeed's members.

The expected groups are written out by hand from DeepSpeed's rules, not computed:
``PipeModelDataParallelTopology`` lays ranks out on axes ``[pipe, data, model]`` with the
model (tensor) axis innermost, sequence parallelism sits between data and tensor, and MoE
expert-parallel groups are ``ep`` consecutive members of a data-parallel group while
expert-data groups stride by ``ep`` (``deepspeed.utils.groups``). One ``run_distributed``
call per world size loops over the shapes inside the workers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.testing import run_distributed
from shardspeed.topology import GROUP_AXES, Topology

S4 = [[0], [1], [2], [3]]
S8 = [[r] for r in range(8)]
W4 = [[0, 1, 2, 3]]
W8 = [list(range(8))]
PAIRS_0246 = [[0, 4], [1, 5], [2, 6], [3, 7]]  # stride 4
PAIRS_STRIDE2 = [[0, 2], [1, 3], [4, 6], [5, 7]]
PAIRS_ADJ = [[0, 1], [2, 3], [4, 5], [6, 7]]
EVEN_ODD = [[0, 2, 4, 6], [1, 3, 5, 7]]

Groups = dict[str, list[list[int]]]  # axis -> every group along it (the world is implied)

# keyed by (pp, dp, tp, sp, ep)
SHAPES_4: dict[tuple[int, ...], Groups] = {
    (1, 4, 1, 1, 1): {  # pure data parallel
        "pipe": S4, "data": W4, "tensor": S4, "sequence": S4, "expert": S4,
        "expert_data": W4, "model": S4, "data_sequence": W4,
    },
    (2, 2, 1, 1, 1): {  # rank = 2 * pipe + data
        "pipe": [[0, 2], [1, 3]], "data": [[0, 1], [2, 3]], "tensor": S4, "sequence": S4,
        "expert": S4, "expert_data": [[0, 1], [2, 3]], "model": [[0, 2], [1, 3]],
        "data_sequence": [[0, 1], [2, 3]],
    },
    (1, 2, 2, 1, 1): {  # rank = 2 * data + tensor
        "pipe": S4, "data": [[0, 2], [1, 3]], "tensor": [[0, 1], [2, 3]], "sequence": S4,
        "expert": S4, "expert_data": [[0, 2], [1, 3]], "model": [[0, 1], [2, 3]],
        "data_sequence": [[0, 2], [1, 3]],
    },
    (2, 1, 2, 1, 1): {  # rank = 2 * pipe + tensor
        "pipe": [[0, 2], [1, 3]], "data": S4, "tensor": [[0, 1], [2, 3]], "sequence": S4,
        "expert": S4, "expert_data": S4, "model": W4, "data_sequence": S4,
    },
    (1, 2, 1, 2, 1): {  # rank = 2 * data + sequence
        "pipe": S4, "data": [[0, 2], [1, 3]], "tensor": S4, "sequence": [[0, 1], [2, 3]],
        "expert": S4, "expert_data": [[0, 2], [1, 3]], "model": S4, "data_sequence": W4,
    },
}  # fmt: skip

SHAPES_8: dict[tuple[int, ...], Groups] = {
    (2, 2, 2, 1, 1): {  # rank = 4 * pipe + 2 * data + tensor (DeepSpeed's example grid)
        "pipe": PAIRS_0246, "data": PAIRS_STRIDE2, "tensor": PAIRS_ADJ, "sequence": S8,
        "expert": S8, "expert_data": PAIRS_STRIDE2, "model": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "data_sequence": PAIRS_STRIDE2,
    },
    (2, 1, 2, 2, 1): {  # rank = 4 * pipe + 2 * sequence + tensor
        "pipe": PAIRS_0246, "data": S8, "tensor": PAIRS_ADJ, "sequence": PAIRS_STRIDE2,
        "expert": S8, "expert_data": S8, "model": [[0, 1, 4, 5], [2, 3, 6, 7]],
        "data_sequence": PAIRS_STRIDE2,
    },
    (1, 2, 2, 2, 1): {  # rank = 4 * data + 2 * sequence + tensor
        "pipe": S8, "data": PAIRS_0246, "tensor": PAIRS_ADJ, "sequence": PAIRS_STRIDE2,
        "expert": S8, "expert_data": PAIRS_0246, "model": PAIRS_ADJ, "data_sequence": EVEN_ODD,
    },
    (1, 4, 2, 1, 1): {  # rank = 2 * data + tensor
        "pipe": S8, "data": EVEN_ODD, "tensor": PAIRS_ADJ, "sequence": S8, "expert": S8,
        "expert_data": EVEN_ODD, "model": PAIRS_ADJ, "data_sequence": EVEN_ODD,
    },
    (1, 4, 2, 1, 2): {  # MoE with tp: experts pair consecutive members of a dp group
        "pipe": S8, "data": EVEN_ODD, "tensor": PAIRS_ADJ, "sequence": S8,
        "expert": [[0, 2], [1, 3], [4, 6], [5, 7]], "expert_data": PAIRS_0246,
        "model": PAIRS_ADJ, "data_sequence": EVEN_ODD,
    },
    (1, 8, 1, 1, 2): {  # DeepSpeed's E + D example: experts [0, 1], [2, 3], ...
        "pipe": S8, "data": W8, "tensor": S8, "sequence": S8, "expert": PAIRS_ADJ,
        "expert_data": EVEN_ODD, "model": S8, "data_sequence": W8,
    },
    (1, 8, 1, 1, 4): {
        "pipe": S8, "data": W8, "tensor": S8, "sequence": S8,
        "expert": [[0, 1, 2, 3], [4, 5, 6, 7]], "expert_data": PAIRS_0246, "model": S8,
        "data_sequence": W8,
    },
}  # fmt: skip


def _layout(shape: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(("pp", "dp", "tp", "sp", "ep"), shape))


def _probe(topo: Topology) -> dict[str, Any]:
    """This rank's members, group rank and rank-sum along every axis, plus its sub-mesh."""
    rank = comm.get_rank()
    out: dict[str, Any] = {}
    for axis in GROUP_AXES:
        group = topo.group(axis)
        assert group is not None, axis
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=group)
        out[axis] = {
            "ranks": dist.get_process_group_ranks(group),
            "group_rank": comm.get_rank(group),
            "sum": t.item(),
            "submesh": topo.submesh(axis).mesh.flatten().tolist(),
            "is_world": group is comm.get_world_group(),
        }
    mesh = topo.mesh
    out["mesh"] = (mesh.mesh.tolist(), mesh.mesh_dim_names, mesh.device_type)
    return out


class _Mpu:
    """A Megatron-style mpu over explicitly given groups."""

    def __init__(self, data: Any, tensor: Any | None, dp: int, tp: int) -> None:
        self.data, self.tensor, self.dp, self.tp = data, tensor, dp, tp

    def get_data_parallel_group(self) -> Any:
        return self.data

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return comm.get_rank(self.data)

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_group(self) -> Any:
        return self.tensor


class _DataOnlyMpu:
    """The collective-check test's mpu: nothing but a data group."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_data_parallel_group(self) -> Any:
        return self.group


def _mesh_worker(shapes: list[tuple[int, ...]], with_mpu: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"shapes": [_probe(Topology.build(**_layout(s))) for s in shapes]}
    if with_mpu:
        rank = comm.get_rank()
        world = comm.new_group([0, 1, 2, 3])  # a world-sized data group of the user's own
        topo = Topology.from_mpu(_DataOnlyMpu(world))
        out["data_only"] = {
            "degrees": (topo.pp, topo.dp, topo.tp, topo.sp),
            "adopted": [a for a in GROUP_AXES if topo.group(a) is world],
            "tensor": dist.get_process_group_ranks(topo.group("tensor")),
        }
        # A data-innermost layout (Megatron with dp first): data [0, 1], tensor [0, 2].
        data = [comm.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
        tensor = [comm.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
        topo = Topology.from_mpu(_Mpu(data, tensor, dp=2, tp=2))
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=topo.group("data"))
        out["other_layout"] = {
            "adopted": topo.group("data") is data and topo.group("tensor") is tensor,
            "data_sum": t.item(),
            "pipe": dist.get_process_group_ranks(topo.group("pipe")),
        }
        try:
            Topology.from_mpu(_Mpu(data, tensor, dp=2, tp=4))
        except ValueError as err:
            out["bad_degrees"] = str(err)
    return out


def _check(world: int, shapes: dict[tuple[int, ...], Groups], results: list[Any]) -> None:
    """Compare every rank's probes with the hand-written groups (and the pure mapping)."""
    for i, (shape, expected) in enumerate(shapes.items()):
        expected = {**expected, "world": [list(range(world))]}
        topo = Topology(world, **_layout(shape))
        for axis, groups in expected.items():  # the hand-written lists are the grid
            assert topo.all_axis_groups(axis) == groups, (shape, axis)
        for rank, result in enumerate(results):
            got = result["shapes"][i]
            dims = (topo.pp, topo.dp // topo.ep, topo.ep, topo.sp, topo.tp)
            assert got["mesh"] == (
                torch.arange(world).reshape(dims).tolist(),
                ("pipe", "expert_data", "expert", "sequence", "tensor"),
                "cpu",
            )
            for axis, groups in expected.items():
                (members,) = [g for g in groups if rank in g]
                r = got[axis]
                where = (shape, axis, rank)
                assert r["ranks"] == members and r["submesh"] == members, (where, r)
                assert r["group_rank"] == members.index(rank), where
                assert r["sum"] == float(sum(members)), where
                assert r["is_world"] == (len(members) == world), where


def test_mesh_groups_on_4_ranks_match_deepspeed_order() -> None:
    results = run_distributed(_mesh_worker, 4, list(SHAPES_4), True, timeout=120)
    _check(4, SHAPES_4, results)
    for rank, r in enumerate(results):
        # the mpu's group also serves the axes with the same members; "world" stays the world
        adopted = ["data", "expert_data", "data_sequence"]
        assert r["data_only"] == {"degrees": (1, 4, 1, 1), "adopted": adopted, "tensor": [rank]}
        other = r["other_layout"]
        assert other["adopted"] and other["data_sum"] == (1.0 if rank < 2 else 5.0)
        assert other["pipe"] == [rank]
        assert "pp*dp*sp*tp = 1*2*1*4 = 8 but world_size is 4" in r["bad_degrees"]


def test_mesh_groups_on_8_ranks_match_deepspeed_order() -> None:
    results = run_distributed(_mesh_worker, 8, list(SHAPES_8), False, timeout=120)
    _check(8, SHAPES_8, results)
