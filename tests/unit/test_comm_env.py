"""Launcher-environment discovery and the comms logger bookkeeping (no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardspeed.comm import logger as comm_logger
from shardspeed.comm.env import discover_env, first_host


@pytest.fixture(autouse=True)
def _fresh_logger():
    comm_logger.reset_state()
    yield
    comm_logger.reset_state()


def test_torchrun_env() -> None:
    env = discover_env(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
         "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"}
    )  # fmt: skip
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.5", 1234, "torchrun")


def test_torchrun_defaults_and_precedence_over_mpi() -> None:
    env = discover_env({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                        "OMPI_COMM_WORLD_SIZE": "4"}, default_port=4321)  # fmt: skip
    assert (env.source, env.world_size, env.local_rank) == ("torchrun", 2, 0)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 4321)


def test_open_mpi_single_node_uses_loopback() -> None:
    env = discover_env(
        {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
         "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    )  # fmt: skip
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("mpi", 2, 4, 2)
    assert env.master_addr == "127.0.0.1" and env.master_port == 29500


def test_open_mpi_multi_node_needs_master_addr() -> None:
    base = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}  # fmt: skip
    assert discover_env(base).master_addr is None
    assert discover_env({**base, "MASTER_ADDR": "node0"}).master_addr == "node0"
    assert discover_env(base, use_mpi=False).source == "none"


def test_pmi_env() -> None:
    env = discover_env({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                        "MPI_LOCALNRANKS": "2"})  # fmt: skip
    assert (env.source, env.rank, env.world_size, env.local_rank, env.master_addr) == (
        "pmi", 1, 2, 1, "127.0.0.1",
    )  # fmt: skip


def test_slurm_step_env() -> None:
    env = discover_env(
        {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1", "SLURM_NTASKS_PER_NODE": "4(x2)"}
    )  # fmt: skip
    assert (env.source, env.rank, env.world_size, env.local_rank) == ("slurm", 6, 8, 2)
    assert env.master_addr == "gpu07" and env.local_world_size == 4
    with_ip = discover_env(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_STEP_ID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}
    )  # fmt: skip
    assert (with_ip.world_size, with_ip.master_addr) == (4, "10.1.2.3")


def test_sbatch_script_without_step_is_single_process() -> None:
    env = discover_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
    assert (env.source, env.world_size, env.rank) == ("none", 1, 0)


def test_no_launcher_is_world_of_one() -> None:
    env = discover_env({})
    assert (env.source, env.rank, env.world_size, env.master_port) == ("none", 0, 1, 29500)
    assert not env.is_multi_process


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 from torchrun is outside [0, 2)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size from torchrun is 0"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "p"}, "MASTER_PORT='p'"),
    ],
)
def test_bad_env_values_name_the_variable(environ: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        discover_env(environ)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node1", "node1"),
        ("gpu[03-05,9]", "gpu03"),
        ("a[1,3],b2", "a1"),
        ("x-y[010-012]", "x-y010"),
    ],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_configure_from_config_object_dict_and_overrides() -> None:
    cfg = SimpleNamespace(comms_logger=SimpleNamespace(
        enabled=True, prof_all=False, prof_ops=["all_reduce"], verbose=False, debug=True))  # fmt: skip
    comm_logger.configure(cfg)
    lg = comm_logger.COMMS_LOGGER
    assert (lg.enabled, lg.prof_all, lg.prof_ops, lg.debug) == (True, False, ["all_reduce"], True)
    assert lg.wants("all_reduce") and not lg.wants("broadcast")
    comm_logger.configure({"comms_logger": {"enabled": False}}, prof_all=True)
    assert (lg.enabled, lg.prof_all, lg.prof_ops) == (False, True, ["all_reduce"])
    comm_logger.configure({"enabled": True})  # the section itself
    assert lg.enabled
    comm_logger.configure({"train_batch_size": 8, "zero_optimization": {}})  # no section
    assert lg.enabled
    with pytest.raises(ValueError, match="prof_ops must be a list"):
        comm_logger.configure(prof_ops="all_reduce")


def test_record_bandwidth_and_summary() -> None:
    lg = comm_logger.COMMS_LOGGER
    lg.record("all_reduce", 4_000_000, 0.002, group_size=4)  # 2 GB/s alg, x1.5 bus
    lg.record("all_gather_into_tensor", 1_000_000, 0.001, group_size=4)
    ops = comm_logger.get_logged_comm_ops()
    assert ops["all_reduce"]["algbw_gbps"] == [pytest.approx(2.0)]
    assert ops["all_reduce"]["busbw_gbps"] == [pytest.approx(3.0)]
    assert ops["all_gather_into_tensor"]["busbw_gbps"] == [pytest.approx(0.75)]
    assert ops["all_reduce"]["avg_latency_ms"] == pytest.approx(2.0)
    table = comm_logger.log_summary()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["op", "count", "total"]
    assert any(line.startswith("all_reduce") and "4.00 MB" in line for line in lines)
    assert any(line.startswith("all_gather_into_tensor") and "1.00 MB" in line for line in lines)
    comm_logger.reset_log()
    assert comm_logger.get_logged_comm_ops() == {}


def test_recent_ops_tags_nest_and_restore() -> None:
    comm_logger.note_op("all_reduce", None, 4, None, False)
    with comm_logger.set_current_tag("outer"):
        comm_logger.note_op("broadcast", None, 2, None, True)
        with comm_logger.set_current_tag("inner"):
            comm_logger.note_op("barrier", None, 0, None, False)
        comm_logger.note_op("send", None, 1, None, False)
    assert [(r["op"], r["tag"]) for r in comm_logger.recent_ops()] == [
        ("all_reduce", None), ("broadcast", "outer"), ("barrier", "inner"), ("send", "outer"),
    ]  # fmt: skip
