"""DeepSpeed module paths: op builders, runner helpers, multi-node backends, monitors, comms log.

Expected command lines and bandwidths marked "DeepSpeed 0.19.8" were recorded once by
running DeepSpeed 0.19.8 on the same inputs; the test needs no DeepSpeed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.launcher import multinode_runner as mnr
from shardspeed.launcher import runner
from shardspeed.launcher.launch import node_command
from shardspeed.launcher.launch import parse_args as launch_parse_args
from shardspeed.monitor import TensorBoardMonitor, WandbMonitor, csvMonitor
from shardspeed.ops import op_builder
from shardspeed.ops.op_builder.all_ops import ALL_OPS
from shardspeed.ops.op_builder.builder import OpBuilder, OpNotAvailableError
from shardspeed.utils.comms_logging import CommsLogger, calc_bw_log, convert_size, get_caller_func

PY = sys.executable

# ------------------------------------------------------------------------------ op builders

REQUIRED_BUILDERS = [
    "CPUAdamBuilder",
    "CPUAdagradBuilder",
    "CPULionBuilder",
    "FusedAdamBuilder",
    "FusedLambBuilder",
    "FusedLionBuilder",
    "AsyncIOBuilder",
    "GDSBuilder",
    "SparseAttnBuilder",
    "TransformerBuilder",
    "InferenceBuilder",
    "QuantizerBuilder",
    "RandomLTDBuilder",
    "EvoformerAttnBuilder",
    "FPQuantizerBuilder",
    "RaggedUtilsBuilder",
    "InferenceCoreBuilder",
    "CCLCommBuilder",
    "ShareMemCommBuilder",
]


@pytest.fixture(autouse=True)
def _fresh_op_cache():
    saved = dict(OpBuilder._loaded_ops)
    OpBuilder._loaded_ops.clear()
    yield
    OpBuilder._loaded_ops.clear()
    OpBuilder._loaded_ops.update(saved)


def test_op_builder_is_a_lazy_attribute_of_ops() -> None:
    import shardspeed

    assert shardspeed.ops.op_builder is op_builder
    assert "op_builder" in dir(shardspeed.ops)


@pytest.mark.parametrize("name", REQUIRED_BUILDERS)
def test_builder_surface(name: str) -> None:
    builder = getattr(op_builder, name)()
    assert isinstance(builder, OpBuilder)
    assert builder.NAME and builder.name == builder.NAME
    assert isinstance(builder.absolute_name(), str)
    assert isinstance(builder.is_compatible(verbose=False), bool)
    assert ALL_OPS[builder.NAME].__class__ is type(builder)


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("FusedAdamBuilder", "shardspeed.ops.adam"),
        ("FusedLambBuilder", "shardspeed.ops.lamb"),
        ("FusedLionBuilder", "shardspeed.ops.lion"),
        ("CPUAdagradBuilder", "shardspeed.ops.adagrad"),
        ("CPULionBuilder", "shardspeed.ops.lion"),
        ("SparseAttnBuilder", "shardspeed.ops.sparse_attention"),
    ],
)
def test_python_op_builders_load_their_module(name: str, module: str) -> None:
    builder = getattr(op_builder, name)()
    assert builder.is_compatible()
    loaded = builder.load()
    assert loaded.__name__ == module == builder.absolute_name()
    assert builder.load() is loaded  # cached per op name


def test_fused_adam_builder_module_holds_fused_adam() -> None:
    assert hasattr(op_builder.FusedAdamBuilder().load(), "FusedAdam")
    assert hasattr(op_builder.CPUAdagradBuilder().load(), "DeepSpeedCPUAdagrad")


@pytest.mark.parametrize(
    "name",
    [
        "TransformerBuilder",
        "InferenceBuilder",
        "QuantizerBuilder",
        "RandomLTDBuilder",
        "EvoformerAttnBuilder",
        "FPQuantizerBuilder",
        "RaggedUtilsBuilder",
        "InferenceCoreBuilder",
        "CCLCommBuilder",
        "ShareMemCommBuilder",
        "GDSBuilder",
    ],
)
def test_unimplemented_ops_are_incompatible_and_say_why(name: str) -> None:
    builder = getattr(op_builder, name)()
    assert builder.is_compatible() is False
    assert builder.error_log
    with pytest.raises(OpNotAvailableError, match=repr(builder.NAME)) as err:
        builder.load()
    assert "ShardSpeed does not implement" in str(err.value)
    assert isinstance(err.value, RuntimeError)  # DeepSpeed raises RuntimeError here


def test_builder_method_explains_jit_only() -> None:
    with pytest.raises(OpNotAvailableError, match=r"CPUAdamBuilder\(\)\.load\(\)"):
        op_builder.CPUAdamBuilder().builder()


def test_cpu_adam_builder_loads_the_native_kernel_module(monkeypatch) -> None:
    from shardspeed.ops.cpu_adam import builder as native

    fake = type(sys)("fake_cpu_adam")
    monkeypatch.setattr(native, "load_cpu_adam", lambda: fake)
    monkeypatch.setattr(op_builder.CPUAdamBuilder, "unavailable_reason", lambda self: None)
    assert op_builder.CPUAdamBuilder().load() is fake
    assert op_builder.CPUAdamBuilder().sources() == [str(native.SOURCE)]


def test_cpu_adam_builder_wraps_a_failed_build(monkeypatch) -> None:
    from shardspeed.ops.cpu_adam import builder as native

    def fail():
        raise native.CpuAdamBuildError("no C++ compiler")

    monkeypatch.setattr(native, "load_cpu_adam", fail)
    monkeypatch.setattr(op_builder.CPUAdamBuilder, "unavailable_reason", lambda self: None)
    with pytest.raises(OpNotAvailableError, match="(?s)cpu_adam.*no C\\+\\+ compiler.*torch"):
        op_builder.CPUAdamBuilder().load()


def test_cpu_adam_incompatible_without_compiler(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    builder = op_builder.CPUAdamBuilder()
    assert builder.is_compatible() is False
    assert "compiler" in builder.error_log


def test_utils_builder_flatten_round_trip() -> None:
    ops = op_builder.UtilsBuilder().load()
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0])]
    flat = ops.flatten(tensors)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7]
    back = ops.unflatten(flat, tensors)
    assert [t.shape for t in back] == [(2, 3), (1,)]
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_async_io_handle_round_trip(tmp_path: Path) -> None:
    aio = op_builder.AsyncIOBuilder().load()
    handle = aio.aio_handle(block_size=4096, queue_depth=8, intra_op_parallelism=2)
    assert (handle.get_block_size(), handle.get_intra_op_parallelism()) == (4096, 2)
    src = torch.arange(5000, dtype=torch.float32)
    path = str(tmp_path / "t.bin")
    assert handle.async_pwrite(src, path) == 0
    assert handle.wait() == 1
    out = handle.new_cpu_locked_tensor(5000, src)
    assert handle.sync_pread(out, path) == 1
    assert torch.equal(out, src)
    with pytest.raises(ValueError, match="file_offset"):
        handle.sync_pread(out, path, 8)


def test_default_compute_capabilities_start_with_deepspeed_base() -> None:
    assert op_builder.get_default_compute_capabilities().startswith("6.0;6.1;7.0")


# ------------------------------------------------------------------------------ runner helpers


def test_parse_args_defaults_match_deepspeed() -> None:
    args = runner.parse_args(["train.py", "--lr", "0.1"])
    # DeepSpeed 0.19.8
    expected = {
        "hostfile": "/job/hostfile",
        "include": "",
        "exclude": "",
        "num_nodes": -1,
        "num_gpus": -1,
        "master_port": 29500,
        "master_addr": "",
        "node_rank": -1,
        "launcher": "pdsh",
        "launcher_args": "",
        "module": False,
        "no_python": False,
        "no_local_rank": False,
        "no_ssh": False,
        "no_ssh_check": False,
        "force_multi": False,
        "save_pid": False,
        "enable_each_rank_log": "None",
        "autotuning": "",
        "user_script": "train.py",
        "user_args": ["--lr", "0.1"],
        "bind_cores_to_rank": False,
        "bind_core_list": None,
        "ssh_port": None,
        "venv_script": None,
        "log_level": "info",
        "quiet": False,
    }
    assert vars(args) == expected
    assert runner.DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"


def test_fetch_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("# cluster\nworker-0 slots=4\n\nworker-1 slots=2\n")
    assert runner.fetch_hostfile(str(path)) == {"worker-0": 4, "worker-1": 2}
    assert list(runner.fetch_hostfile(str(path))) == ["worker-0", "worker-1"]
    assert runner.fetch_hostfile(str(tmp_path / "missing")) is None
    path.write_text("worker-0 slots=4\nworker-0 slots=2\n")
    with pytest.raises(ValueError, match="twice"):
        runner.fetch_hostfile(str(path))


POOL = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


def test_parse_resource_filter_matches_deepspeed() -> None:
    # DeepSpeed 0.19.8
    assert runner.parse_resource_filter(POOL, include_str="worker-0@worker-1:0,2") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 2],
    }
    assert runner.parse_resource_filter(POOL, exclude_str="worker-1:0") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [1, 2, 3],
    }
    assert runner.parse_resource_filter(POOL) == POOL
    with pytest.raises(ValueError, match="mutually exclusive"):
        runner.parse_resource_filter(POOL, include_str="worker-0", exclude_str="worker-1")
    with pytest.raises(ValueError, match="unknown host"):
        runner.parse_resource_filter(POOL, include_str="worker-9")
    with pytest.raises(ValueError, match="no slot 7"):
        runner.parse_resource_filter(POOL, include_str="worker-0:7")


def test_parse_inclusion_exclusion() -> None:
    # DeepSpeed 0.19.8
    assert runner.parse_inclusion_exclusion({"worker-0": 4, "worker-1": 4}, "", "worker-0") == {
        "worker-1": [0, 1, 2, 3]
    }
    assert runner.parse_inclusion_exclusion({"a": 2, "b": 2}, "b:1", "") == {"b": [1]}


def test_apply_num_nodes_and_gpus() -> None:
    assert runner.apply_num_nodes_and_gpus(POOL, 1, 2) == {"worker-0": [0, 1]}
    assert runner.apply_num_nodes_and_gpus(POOL, -1, -1) == POOL


def test_world_info_round_trip() -> None:
    world = {"worker-0": [0, 1], "worker-1": [0, 1]}
    encoded = runner.encode_world_info(world)
    assert encoded == "eyJ3b3JrZXItMCI6IFswLCAxXSwgIndvcmtlci0xIjogWzAsIDFdfQ=="  # DeepSpeed 0.19.8
    assert runner.decode_world_info(encoded) == world
    with pytest.raises(ValueError, match="world_info"):
        runner.decode_world_info("not base64!")


def test_launch_module_picks_this_nodes_slots() -> None:
    world = runner.encode_world_info({"worker-0": [0, 1], "worker-1": [2, 3, 5]})
    args = launch_parse_args(
        [f"--world_info={world}", "--node_rank=1", "--master_addr=10.0.0.1", "train.py", "--x"]
    )
    argv, env = node_command(args)
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3,5"}
    joined = " ".join(argv)
    assert "--nnodes 2 --nproc_per_node 3 --node_rank 1 --master_addr 10.0.0.1" in joined
    assert argv[-2:] == ["train.py", "--x"]


# ------------------------------------------------------------------------------ backends


def _ds_args(*argv: str) -> argparse.Namespace:
    return runner.parse_args(list(argv))


def _sub(cmd: list[str]) -> list[str]:
    return [part.replace(PY, "PY") for part in cmd]


ARGS = (
    "--hostfile",
    "/tmp/hf",
    "--master_addr",
    "10.0.0.1",
    "--launcher_args",
    "--foo bar",
    "train.py",
    "--lr",
    "0.1",
    "a b",
)
WORLD = "eyJ3b3JrZXItMCI6IFswLCAxXSwgIndvcmtlci0xIjogWzAsIDFdfQ=="
ACTIVE = {"worker-0": [0, 1], "worker-1": [0, 1]}
RESOURCE_POOL = {"worker-0": 2, "worker-1": 2}


def test_pdsh_runner_command() -> None:
    pdsh = mnr.PDSHRunner(_ds_args(*ARGS), WORLD)
    pdsh.add_export("NCCL_DEBUG", "INFO")
    pdsh.add_export("X", "a b")
    cmd, kill, env = pdsh.get_cmd({}, ACTIVE)
    # DeepSpeed 0.19.8, with its per-node module deepspeed.launcher.launch -> ours
    cwd = str(Path.cwd())
    assert _sub(cmd) == [
        "pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "--foo", "bar",
        'export NCCL_DEBUG=INFO; export X="a b"; ', f"cd {cwd};", "PY", "-u", "-m",
        "shardspeed.launcher.launch", f"--world_info={WORLD}", "--node_rank=%n",
        "--master_addr=10.0.0.1", "--master_port=29500", "--enable_each_rank_log=None",
        "train.py", "--lr", "0.1", '"a b"',
    ]  # fmt: skip
    assert env == {"PDSH_RCMD_TYPE": "ssh"}
    assert kill[-2:] == ["pkill -f ", f"{PY}\\ -u\\ -m\\ shardspeed.launcher.launch"]
    assert pdsh.name == "pdsh"


def test_openmpi_runner_command() -> None:
    # DeepSpeed 0.19.8
    cmd = mnr.OpenMPIRunner(_ds_args(*ARGS), WORLD, RESOURCE_POOL).get_cmd({}, ACTIVE)
    assert _sub(cmd) == [
        "mpirun", "-n", "4", "-hostfile", "/tmp/hf", "--mca", "btl", "^openib", "--mca",
        "btl_tcp_if_include", "eth0", "--foo", "bar", "-x", "UCX_TLS=tcp", "PY", "-u",
        "train.py", "--lr", "0.1", "a b",
    ]  # fmt: skip


def test_impi_runner_command() -> None:
    # DeepSpeed 0.19.8
    cmd = mnr.IMPIRunner(_ds_args(*ARGS), WORLD, RESOURCE_POOL).get_cmd({}, ACTIVE)
    head = [
        "mpirun", "-ppn", "2", "--foo", "bar", "-genv", "MASTER_ADDR", "10.0.0.1", "-genv",
        "MASTER_PORT", "29500", "-genv", "WORLD_SIZE", "4", "-genv", "LOCAL_SIZE", "2",
        "-genv", "I_MPI_PIN", "0", "-hosts", "worker-0,worker-1",
    ]  # fmt: skip
    sections = []
    for rank, local in ((0, 0), (1, 1), (2, 0), (3, 1)):
        sections += [":"] if rank else []
        sections += ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(local)]
        sections += ["PY", "-u", "train.py", "--lr", "0.1", "a b"]
    assert _sub(cmd) == head + sections


def test_mpich_runner_command() -> None:
    cmd = mnr.MPICHRunner(_ds_args(*ARGS), WORLD, RESOURCE_POOL).get_cmd({}, ACTIVE)
    assert cmd[:5] == ["mpirun", "-n", "4", "-ppn", "2"]
    assert ["-hosts", "worker-0,worker-1"] == cmd[cmd.index("-hosts") : cmd.index("-hosts") + 2]
    with pytest.raises(ValueError, match="same number of slots"):
        mnr.MPICHRunner(_ds_args(*ARGS), WORLD, {"a": 2, "b": 4}).get_cmd({}, ACTIVE)


def test_slurm_runner_command() -> None:
    args = _ds_args(
        "--include", "worker-0@worker-1", "--master_addr", "10.0.0.1", "train.py", "--x"
    )
    cmd = mnr.SlurmRunner(args, WORLD, RESOURCE_POOL).get_cmd({}, ACTIVE)
    # DeepSpeed 0.19.8
    assert _sub(cmd) == [
        "srun", "-n", "4", "--nodelist", "worker-0,worker-1", "--nodes", "2", "--export=ALL",
        "PY", "-u", "train.py", "--x",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="device ids"):
        mnr.SlurmRunner.validate_active_resources({"worker-0": [1, 2]})


def test_mpi_backends_refuse_filters() -> None:
    args = _ds_args("--include", "worker-0", "train.py")
    for cls in (mnr.OpenMPIRunner, mnr.MPICHRunner, mnr.IMPIRunner, mnr.MVAPICHRunner):
        with pytest.raises(ValueError, match="--include/--exclude"):
            cls(args, WORLD, RESOURCE_POOL)


def test_backend_exists_is_a_lookup(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert not mnr.PDSHRunner(_ds_args("train.py"), WORLD).backend_exists()
    assert not mnr.SlurmRunner(_ds_args("train.py"), WORLD, RESOURCE_POOL).backend_exists()


def test_add_export_quotes_odd_values() -> None:
    pdsh = mnr.PDSHRunner(_ds_args("train.py"), WORLD)
    pdsh.add_export(" A ", " x/y:z ")
    pdsh.add_export("B", "has space")
    assert pdsh.exports == {"A": "x/y:z", "B": '"has space"'}


# ------------------------------------------------------------------------------ monitors


def test_csv_monitor_writes_deepspeed_layout(tmp_path: Path) -> None:
    monitor = csvMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    assert monitor.enabled and monitor.log_dir == str(tmp_path / "job")
    monitor.write_events([("Train/Samples/loss", 2.5, 8), ("Train/Samples/loss", 2.0, 16)])
    monitor.write_events([("lr", torch.tensor(0.1), 8)])
    assert sorted(monitor.filenames) == ["Train_Samples_loss", "lr"]
    monitor.close()
    loss = (tmp_path / "job" / "Train_Samples_loss.csv").read_text()
    assert loss.splitlines() == ["step,loss", "8,2.5", "16,2.0"]
    assert (tmp_path / "job" / "lr.csv").read_text().splitlines()[0] == "step,lr"


def test_disabled_monitors_write_nothing(tmp_path: Path) -> None:
    monitor = csvMonitor({"enabled": False, "output_path": str(tmp_path)})
    monitor.write_events([("x", 1.0, 1)])
    assert monitor.log_dir is None and not any(tmp_path.iterdir())
    assert TensorBoardMonitor({"enabled": False}).summary_writer is None
    WandbMonitor({"enabled": False}).write_events([("x", 1.0, 1)])


def test_csv_monitor_other_ranks_do_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monitor = csvMonitor({"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    monitor.write_events([("x", 1.0, 1)])
    assert not (tmp_path / "job").exists()


def test_enabled_monitor_without_package_names_the_fix(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.delitem(sys.modules, "tensorboard", raising=False)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a),
    )
    with pytest.raises(ValueError, match="pip install wandb"):
        WandbMonitor({"enabled": True})
    with pytest.raises(ValueError, match="pip install tensorboard"):
        TensorBoardMonitor({"enabled": True})


# ------------------------------------------------------------------------------ comms logging


@pytest.mark.parametrize(
    ("op", "expected"),
    [  # DeepSpeed 0.19.8, 8 ranks, 1e6 bytes in 2 ms
        ("all_reduce", (8.0, 7.0)),
        ("all_gather_into_tensor", (32.0, 28.0)),
        ("reduce_scatter_tensor", (32.0, 28.0)),
        ("all_to_all_single", (4.0, 3.5)),
        ("broadcast", (4.0, 4.0)),
        ("send", (4.0, 4.0)),
        ("barrier", (4.0, 4.0)),
    ],
)
def test_calc_bw_log_matches_deepspeed(op: str, expected: tuple[float, float]) -> None:
    assert calc_bw_log(op, 1_000_000, 2.0, world_size=8) == pytest.approx(expected)


def test_calc_bw_log_by_hand() -> None:
    # all_reduce of 1 GB in 100 ms on 4 ranks: algbw = 2 * 1e9 B / 0.1 s = 160 Gbit/s;
    # busbw = 1e9 B / 0.1 s * 2 * 3/4 * 8 bit = 120 Gbit/s
    assert calc_bw_log("all_reduce", 1e9, 100.0, world_size=4) == pytest.approx((160.0, 120.0))
    with pytest.raises(ValueError, match="comm_op='alll_reduce'"):
        calc_bw_log("alll_reduce", 1, 1.0)


@pytest.mark.parametrize(
    ("size", "text"),  # DeepSpeed 0.19.8
    [(0, "0B"), (1, "1.0 B"), (1023, "1023.0 B"), (1024, "1.0 KB"), (1536, "1.5 KB"),
     (10**9, "953.67 MB"), (123456789, "117.74 MB")],
)  # fmt: skip
def test_convert_size(size: int, text: str) -> None:
    assert convert_size(size) == text


def test_get_caller_func() -> None:
    def inner() -> str:
        return get_caller_func(frame=2)

    def outer() -> str:
        return inner()

    assert outer() == "outer"


def test_comms_logger_records_and_summarises() -> None:
    log = CommsLogger()
    assert not log.enabled and log.prof_all and log.prof_ops == []
    log.configure({"comms_logger": {"enabled": True, "verbose": False, "prof_ops": ["x"]}})
    assert log.enabled and log.prof_ops == ["x"]
    for latency in (2.0, 4.0):
        log.append("all_reduce", "all_reduce", latency, 1_000_000)
    log.append("broadcast", "broadcast", 1.0, 10)
    raw = log.get_raw_data()
    count, lats, algbws, busbws = raw["all_reduce"][1_000_000]
    assert (count, lats) == (2, [2.0, 4.0])
    assert algbws == pytest.approx([8.0, 4.0])  # world size 1: 2 * 1e6 B / t ms
    assert busbws == [0.0, 0.0]  # 2(n-1)/n = 0 for one rank
    assert log.get_total_operations() == 3
    assert log.get_operation_names() == ["all_reduce", "broadcast"]
    summary = log.get_operation_summary("all_reduce")[1_000_000]
    assert summary["avg_latency_ms"] == pytest.approx(3.0)
    assert summary["msg_size_str"] == "976.56 KB"
    result = log.log_all(print_log=True, return_dict=True)
    assert result["summary"]["broadcast"][10]["count"] == 1
    assert result["metadata"]["world_size"] == 1
    log.start_profiling_op(["all_gather"])
    log.stop_profiling_op(["x"])
    assert log.prof_ops == ["all_gather"]
    log.reset_data()
    assert not log.has_data()


def test_comms_logger_configure_from_deepspeed_comms_config() -> None:
    section = argparse.Namespace(verbose=True, debug=False, prof_ops=[], prof_all=False)
    log = CommsLogger()
    log.configure(argparse.Namespace(comms_logger_enabled=True, comms_logger=section))
    assert log.enabled and log.verbose and not log.prof_all
