"""shardspeed.comm on real process groups (gloo, CPU)."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.testing import distributed_test, run_distributed


@distributed_test(world_size=2)
def test_logged_bytes_follow_the_size_rule() -> None:
    rank = comm.get_rank()
    comm.configure(enabled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated torch names on the path
        t = torch.full((10,), float(rank + 1))  # fp32: 40 B
        comm.all_reduce(t)
        gathered = torch.empty(6)
        comm.all_gather_into_tensor(gathered, torch.full((3,), float(rank)))  # out 24 B
        rs_out = torch.empty(4, dtype=torch.float16)
        rs_in = torch.arange(8, dtype=torch.float16)  # in 16 B
        comm.reduce_scatter_tensor(rs_out, rs_in)
        b = torch.arange(5) if rank == 0 else torch.zeros(5, dtype=torch.int64)
        comm.broadcast(b, src=0)  # int64: 40 B
        a2a_out = torch.empty(4)
        comm.all_to_all_single(a2a_out, torch.arange(4.0) + 10 * rank)  # in 16 B
        lst = [torch.empty(2, dtype=torch.float64) for _ in range(2)]
        comm.all_gather(lst, torch.full((2,), float(rank), dtype=torch.float64))  # out 32 B
        comm.barrier()
        comm.reduce_scatter_fn(rs_out, rs_in)  # alias: same op name
    assert t.tolist() == [3.0] * 10
    assert gathered.tolist() == [0.0] * 3 + [1.0] * 3
    assert rs_out.tolist() == ([0, 2, 4, 6] if rank == 0 else [8, 10, 12, 14])
    assert b.tolist() == [0, 1, 2, 3, 4]
    assert a2a_out.tolist() == ([0, 1, 10, 11] if rank == 0 else [2, 3, 12, 13])
    assert [x.tolist() for x in lst] == [[0.0, 0.0], [1.0, 1.0]]

    ops = comm.get_logged_comm_ops()
    expected = {
        "all_reduce": (1, 40),
        "all_gather_into_tensor": (1, 24),
        "reduce_scatter_tensor": (2, 32),
        "broadcast": (1, 40),
        "all_to_all_single": (1, 16),
        "all_gather": (1, 32),
        "barrier": (1, 0),
    }
    assert {k: (v["count"], v["total_bytes"]) for k, v in ops.items()} == expected
    ar = ops["all_reduce"]
    assert len(ar["latencies_ms"]) == 1 and ar["total_latency_ms"] > 0
    assert ar["busbw_gbps"][0] == ar["algbw_gbps"][0]  # 2(n-1)/n == 1 for n=2
    table = comm.log_summary(show_straggler=True)
    assert "reduce_scatter_tensor" in table and "straggler" in table
    comm.reset_log()
    assert comm.get_logged_comm_ops() == {}


@distributed_test(world_size=2)
def test_async_ops_are_timed_until_wait() -> None:
    t = torch.ones(8)
    plain = comm.all_reduce(t, async_op=True)
    assert not isinstance(plain, comm.TimedWork)  # logger off: torch's handle untouched
    plain.wait()
    comm.configure(
        {"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}}
    )
    work = comm.all_reduce(t, async_op=True)
    assert isinstance(work, comm.TimedWork)
    assert comm.get_logged_comm_ops() == {}  # not recorded before wait()
    work.wait()
    work.wait()  # idempotent
    comm.broadcast(t, src=0)  # not in prof_ops
    ops = comm.get_logged_comm_ops()
    assert list(ops) == ["all_reduce"] and ops["all_reduce"]["count"] == 1
    assert ops["all_reduce"]["total_bytes"] == 32
    assert t.tolist() == [4.0] * 8


@distributed_test(world_size=2)
def test_point_to_point() -> None:
    rank, peer = comm.get_rank(), 1 - comm.get_rank()
    comm.configure(enabled=True)
    if rank == 0:
        comm.send(torch.tensor([7.0, 8.0]), dst=1)
    else:
        buf = torch.empty(2)
        assert comm.recv(buf, src=0) == 0
        assert buf.tolist() == [7.0, 8.0]
    out, inbox = torch.full((3,), float(rank)), torch.empty(3)
    reqs = [comm.isend(out, peer), comm.irecv(inbox, peer)]
    for r in reqs:
        r.wait()
    assert inbox.tolist() == [float(peer)] * 3
    batch_in = torch.empty(4, dtype=torch.int32)
    ops = [
        comm.P2POp(comm.isend, torch.full((4,), rank, dtype=torch.int32), peer),
        comm.P2POp(dist.irecv, batch_in, peer),  # torch's own functions work too
    ]
    for w in comm.batch_isend_irecv(ops):
        w.wait()
    assert batch_in.tolist() == [peer] * 4
    logged = comm.get_logged_comm_ops()
    assert logged["batch_isend_irecv"]["count"] == 1
    assert logged["batch_isend_irecv"]["total_bytes"] == 32
    assert logged["isend"]["total_bytes"] == logged["irecv"]["total_bytes"] == 12
    assert logged["send" if rank == 0 else "recv"]["total_bytes"] == 8


@distributed_test(world_size=2)
def test_recent_ops_ring_buffer_and_tags() -> None:
    t = torch.zeros(3, dtype=torch.bfloat16)
    with comm.set_current_tag("zero.reduce_grads bucket 0"):
        comm.all_reduce(t)
        with comm.set_current_tag("inner"):
            comm.broadcast(t, src=0)
    comm.barrier()
    recent = comm.recent_ops()
    assert [(r["op"], r["tag"]) for r in recent] == [
        ("all_reduce", "zero.reduce_grads bucket 0"),
        ("broadcast", "inner"),
        ("barrier", None),
    ]
    assert recent[0]["numel"] == 3 and recent[0]["dtype"] == "bfloat16"
    assert recent[0]["group_size"] == 2
    for _ in range(70):
        comm.all_reduce(t)
    recent = comm.recent_ops()
    assert len(recent) == 64 and recent[-1]["seq"] == 72


def _fresh_state_and_groups() -> dict:
    # reset hooks ran before this call: the logger and the ring buffer start empty
    state = {"logged": comm.get_logged_comm_ops(), "recent": len(comm.recent_ops())}
    comm.configure(enabled=True)
    comm.init_distributed()  # already initialised by the harness: a no-op
    rank = comm.get_rank()
    odd = comm.new_group([1, 3])
    even = comm.new_group([0, 2])
    mine = odd if rank % 2 else even
    t = torch.tensor([float(rank)])
    comm.all_reduce(t, group=mine)
    state["sum"] = t.item()
    state["group_rank"] = comm.get_rank(mine)
    state["global_of_1"] = comm.get_global_rank(mine, 1)
    objs = [{"from": rank}] if rank == 0 else [None]
    comm.broadcast_object_list(objs, src=0)
    gathered: list = [None] * comm.get_world_size()
    comm.all_gather_object(gathered, rank * 10)
    state["obj"], state["gathered"] = objs[0], gathered
    state["world_group_size"] = comm.get_world_size(comm.get_world_group())
    state["local_rank"] = comm.get_local_rank()
    return state


def test_groups_objects_and_state_reset_between_calls() -> None:
    for _ in range(2):  # the second call must not see the first call's logger state
        results = run_distributed(_fresh_state_and_groups, 4)
        for rank, r in enumerate(results):
            assert r["logged"] == {} and r["recent"] == 0
            assert r["sum"] == (4.0 if rank % 2 else 2.0)
            assert r["group_rank"] == rank // 2
            assert r["global_of_1"] == (3 if rank % 2 else 2)
            assert r["obj"] == {"from": 0}
            assert r["gathered"] == [0, 10, 20, 30]
            assert r["world_group_size"] == 4
            assert r["local_rank"] == rank


def _single_process_init() -> dict:
    dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    comm.init_distributed(timeout=timedelta(seconds=77), verbose=False)
    group = comm.new_group([0])
    t = torch.ones(2)
    comm.all_reduce(t, group=group)
    return {
        "world": comm.get_world_size(),
        "rank": comm.get_rank(),
        "timeout": comm.get_timeout().total_seconds(),
        "value": t.tolist(),
    }


def test_init_distributed_without_launcher_is_a_world_of_one() -> None:
    (r,) = run_distributed(_single_process_init, 1)
    assert r == {"world": 1, "rank": 0, "timeout": 77.0, "value": [1.0, 1.0]}


# ----------------------------------------------------------------- Topology groups
_LAYOUTS = [
    {"pp": 2, "tp": 2},
    {"dp": 2, "tp": 2},
    {"dp": 4, "ep": 2},
    {"dp": 2, "sp": 2},
    {"pp": 4},
]


def _topology_sums() -> list[dict]:
    from shardspeed.topology import GROUP_AXES, Topology

    rank = comm.get_rank()
    out = []
    for layout in _LAYOUTS:
        topo = Topology.build(**layout)
        sums = {}
        for axis in GROUP_AXES:
            group = topo.group(axis)
            t = torch.tensor([float(rank)])
            comm.all_reduce(t, group=group)
            sums[axis] = (t.item(), comm.get_world_size(group), comm.get_rank(group))
        out.append(sums)
    return out


def test_topology_groups_reduce_over_their_axis() -> None:
    from shardspeed.topology import GROUP_AXES, Topology

    results = run_distributed(_topology_sums, 4)
    for i, layout in enumerate(_LAYOUTS):
        topo = Topology(4, **layout)
        for rank in range(4):
            for axis in GROUP_AXES:
                members = topo.axis_ranks(axis, rank)
                total, size, group_rank = results[rank][i][axis]
                assert total == float(sum(members)), (layout, axis, rank)
                assert size == len(members)
                assert group_rank == members.index(rank)
