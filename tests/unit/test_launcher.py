"""Unit tests for the ``shardspeed`` launcher: parsing, selection, commands, dry run, report."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from shardspeed.launcher.cli import SUBCOMMANDS, main
from shardspeed.launcher.commands import (
    SHIM_MODULE,
    build_remote_command,
    build_ssh_argv,
    build_torchrun_argv,
    format_command,
)
from shardspeed.launcher.environment import parse_env_file, propagated_env, remote_env
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.hostfile import (
    limit_resources,
    parse_hostfile,
    pool_from_hostfile,
    read_hostfile,
    select_resources,
)
from shardspeed.launcher.local_rank_shim import shim_argv
from shardspeed.launcher.plan import LaunchOptions, build_plan, resolve_pool
from shardspeed.launcher.process import run_local, run_remote
from shardspeed.launcher.report import collect_report, format_report

POOL = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


# --- hostfile ---------------------------------------------------------------------------


def test_parse_hostfile_comments_blank_lines_and_order() -> None:
    text = "# cluster\n\nworker-1 slots=4   # fast node\nworker-0 slots=2\n  \n"
    hosts = parse_hostfile(text)
    assert hosts == {"worker-1": 4, "worker-0": 2}
    assert list(hosts) == ["worker-1", "worker-0"]
    assert pool_from_hostfile(hosts) == {"worker-1": [0, 1, 2, 3], "worker-0": [0, 1]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a slots=1\nb slots=2\na slots=4\n", "line 3: host 'a' is listed twice (first on line 1)"),
        ("a slots=1\nb\n", "line 2: expected 'HOSTNAME slots=N', got 'b'"),
        ("a slots=1\n\nb slots=2 extra\n", "line 3: expected 'HOSTNAME slots=N'"),
        ("a slot=2\n", "line 1: expected 'HOSTNAME slots=N'"),
        ("a slots=0\n", "line 1: slots for host 'a' must be a positive integer, got '0'"),
        ("a slots=x\n", "line 1: slots for host 'a' must be a positive integer, got 'x'"),
        ("a@b slots=1\n", "line 1: invalid host name 'a@b'"),
        ("# only a comment\n\n", "lists no hosts"),
    ],
)
def test_parse_hostfile_errors(text: str, expected: str) -> None:
    with pytest.raises(LauncherError) as info:
        parse_hostfile(text, source="hostfile 'h'")
    assert expected in str(info.value)
    assert str(info.value).startswith("hostfile 'h'")


def test_read_hostfile_missing_names_flag(tmp_path: Path) -> None:
    with pytest.raises(LauncherError, match="-H/--hostfile .*nope.*file not found"):
        read_hostfile(tmp_path / "nope")


# --- include / exclude / counts ---------------------------------------------------------


def test_include_hosts_and_slots_keeps_pool_order() -> None:
    assert select_resources(POOL, include="worker-1:2,0@worker-0") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 2],
    }


def test_exclude_slot_and_whole_host() -> None:
    assert select_resources(POOL, exclude="worker-1:0@worker-2") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [1, 2, 3],
    }


def test_localhost_include() -> None:
    assert select_resources({"localhost": [0, 1, 2, 3]}, include="localhost:0,1") == {
        "localhost": [0, 1]
    }


@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ("worker-0", "worker-1", "--include 'worker-0' and --exclude 'worker-1' are mutually"),
        ("worker-9", "", "--include 'worker-9': unknown host 'worker-9'; known hosts: worker-0"),
        ("", "worker-0:7", "--exclude 'worker-0:7': host 'worker-0' has no slot 7"),
        ("worker-0:a", "", "--include 'worker-0:a': slots for host 'worker-0' must be"),
        ("worker-0@@worker-1", "", "--include 'worker-0@@worker-1': empty host entry"),
        ("worker-0@worker-0:1", "", "host 'worker-0' appears twice"),
        ("", "worker-0@worker-1@worker-2", "--exclude 'worker-0@worker-1@worker-2' removes every"),
        ("worker-0:-1", "", "slot ids are >= 0"),
    ],
)
def test_select_errors(include: str, exclude: str, expected: str) -> None:
    with pytest.raises(LauncherError) as info:
        select_resources(POOL, include=include, exclude=exclude)
    assert expected in str(info.value)


def test_limit_resources() -> None:
    assert limit_resources(POOL, num_nodes=2, num_gpus=2) == {
        "worker-0": [0, 1],
        "worker-1": [0, 1],
    }
    assert limit_resources(POOL) == POOL
    with pytest.raises(LauncherError, match="--num_nodes 4 is larger than the 3 host"):
        limit_resources(POOL, num_nodes=4)
    with pytest.raises(LauncherError, match="--num_gpus/--nproc 3 exceeds the 2 slot.*worker-2"):
        limit_resources(POOL, num_gpus=3)
    with pytest.raises(LauncherError, match="--num_nodes must be a positive integer.*got 0"):
        limit_resources(POOL, num_nodes=0)


# --- commands ---------------------------------------------------------------------------


def test_build_torchrun_argv_single_node_with_local_rank_shim() -> None:
    argv = build_torchrun_argv(
        num_nodes=1,
        nproc_per_node=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        user_script="train.py",
        user_args=["--lr", "0.1"],
        python="py",
    )
    assert argv == [
        "py", "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
        "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", "29500",
        "--module", SHIM_MODULE, "--", "train.py", "--lr", "0.1",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "tail"),
    [
        ({"no_local_rank": True}, ["train.py", "--x"]),
        ({"no_local_rank": True, "module": True}, ["--module", "train.py", "--x"]),
        ({"no_local_rank": True, "no_python": True}, ["--no-python", "train.py", "--x"]),
        ({"module": True}, ["--module", SHIM_MODULE, "--module", "--", "train.py", "--x"]),
        ({"log_dir": "logs"}, ["--log_dir", "logs", "--tee", "3", "--module", SHIM_MODULE]),
    ],
)
def test_build_torchrun_argv_entry_variants(flags: dict, tail: list[str]) -> None:
    argv = build_torchrun_argv(
        num_nodes=2,
        nproc_per_node=4,
        node_rank=1,
        master_addr="w0",
        master_port=1234,
        user_script="train.py",
        user_args=["--x"],
        **flags,
    )
    joined = " ".join(argv)
    assert (
        "--nnodes 2 --nproc_per_node 4 --node_rank 1 --master_addr w0 --master_port 1234" in joined
    )
    assert " ".join(tail) in joined


def test_remote_command_quotes_values_and_round_trips() -> None:
    env = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/a b/c"}
    command = build_remote_command(["py", "train.py", "--msg", "it's"], "/work dir", env)
    assert command.startswith("cd '/work dir' && export NCCL_DEBUG=INFO PYTHONPATH='/a b/c' && ")
    assert shlex.split(command.split(" && ")[-1]) == ["py", "train.py", "--msg", "it's"]
    ssh = build_ssh_argv("w1", command, ssh_port=2222)
    assert ssh[:4] == ["ssh", "-p", "2222", "w1"] and ssh[4] == command
    assert build_ssh_argv("w1", "true") == ["ssh", "w1", "true"]
    assert format_command(["a", "b c"], {"X": "1 2"}) == "X='1 2' a 'b c'"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--", "t.py", "--a"], ["py", "-u", "t.py", "--local_rank=3", "--a"]),
        (["--module", "--", "pkg.m"], ["py", "-u", "-m", "pkg.m", "--local_rank=3"]),
        (["--no-python", "--", "./run.sh", "x"], ["./run.sh", "--local_rank=3", "x"]),
    ],
)
def test_local_rank_shim_argv(args: list[str], expected: list[str]) -> None:
    assert shim_argv(args, "3", python="py") == expected


def test_local_rank_shim_missing_target() -> None:
    with pytest.raises(ValueError, match="missing TARGET"):
        shim_argv(["--module", "--"], "0")


# --- environment propagation ------------------------------------------------------------


def test_propagated_env_prefixes() -> None:
    environ = {"NCCL_IB_HCA": "mlx5", "PYTHONPATH": "/p", "UCX_TLS": "rc", "MV2_X": "1",
               "SHARDSPEED_LOG_LEVEL": "DEBUG", "HOME": "/h", "PATH": "/bin", "NCCLX": "no"}  # fmt: skip
    assert propagated_env(environ) == {
        "MV2_X": "1",
        "NCCL_IB_HCA": "mlx5",
        "PYTHONPATH": "/p",
        "SHARDSPEED_LOG_LEVEL": "DEBUG",
        "UCX_TLS": "rc",
    }


def test_parse_env_file() -> None:
    text = "# comment\nA=1\n\nexport B = two words\nC='quoted'\nD=x=y\n"
    assert parse_env_file(text) == {"A": "1", "B": "two words", "C": "quoted", "D": "x=y"}
    with pytest.raises(LauncherError, match="env file line 2: expected 'VAR=VALUE', got 'oops'"):
        parse_env_file("A=1\noops\n")


def test_remote_env_files_home_then_cwd(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".shardspeed_env").write_text("B=cwd\n")
    env = remote_env({"NCCL_DEBUG": "INFO", "OTHER": "x"}, cwd, home)
    assert env == {"NCCL_DEBUG": "INFO", "A": "home", "B": "cwd"}
    (cwd / "custom_env").write_text("C=3\n")
    assert remote_env({"DS_ENV_FILE": "custom_env"}, cwd, home) == {"C": "3"}


# --- plan and the command line (dry run) ------------------------------------------------


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cwd with train.py and a two-host hostfile; a clean HOME; CPU forced."""
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SHARDSPEED_ACCELERATOR", "cpu")
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    return tmp_path


def _remote_parts(line: str) -> tuple[list[str], str, list[str]]:
    """Split a dry-run ssh line into (ssh argv, exports, torchrun argv)."""
    ssh = shlex.split(line)
    parts = ssh[-1].split(" && ")
    return ssh[:-1], parts[1], shlex.split(parts[-1])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dry_run_two_hosts(workdir: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    (workdir / ".deepspeed_env").write_text("MY_VAR=hello world\n")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    code = main(["--dry_run", "-H", "hostfile", "--master_port", "29611", "train.py", "--lr", "1"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    ranks = []
    for host, line in zip(["worker-0", "worker-1"], lines):
        ssh, exports, argv = _remote_parts(line)
        assert ssh == ["ssh", host]
        assert "NCCL_DEBUG=INFO" in exports and "MY_VAR='hello world'" in exports
        assert argv[1:3] == ["-m", "torch.distributed.run"]
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--nproc_per_node") == "2"
        assert _flag(argv, "--master_addr") == "worker-0"
        assert _flag(argv, "--master_port") == "29611"
        assert argv[-4:] == ["--", "train.py", "--lr", "1"]
        ranks.append(_flag(argv, "--node_rank"))
    assert ranks == ["0", "1"]
    assert f"cd {workdir}" in lines[0] or f"cd '{workdir}'" in lines[0]


def test_dry_run_single_node_cpu(workdir: Path, capsys) -> None:
    assert main(["--dry_run", "--nproc", "2", "train.py", "--nproc", "9"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    argv = shlex.split(line)
    assert argv[0] == sys.executable
    assert _flag(argv, "--nnodes") == "1" and _flag(argv, "--nproc_per_node") == "2"
    assert _flag(argv, "--master_addr") == "127.0.0.1" and _flag(argv, "--master_port") == "29500"
    assert argv[-3:] == ["train.py", "--nproc", "9"]  # script args are not launcher flags


def test_dry_run_pdsh_and_no_ssh(workdir: Path, capsys) -> None:
    argv = ["--dry_run", "-H", "hostfile", "--launcher", "pdsh", "--ssh_port", "2200", "train.py"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert all(
        "PDSH_SSH_ARGS_APPEND='-p 2200'" in line and " pdsh -S -w " in line for line in lines
    )
    assert main(["--dry_run", "-H", "hostfile", "--no_ssh", "--node_rank", "1", "train.py"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    local = shlex.split(line)
    assert local[0] == sys.executable
    assert _flag(local, "--node_rank") == "1" and _flag(local, "--master_addr") == "worker-0"


def test_plan_gpu_selection_sets_visible_devices(workdir: Path) -> None:
    opts = LaunchOptions(user_script="train.py", include="localhost:3,7")
    environ = {"CUDA_VISIBLE_DEVICES": "2,3,5,7"}
    resolved = resolve_pool(opts, environ, device_count=4)
    (node,) = build_plan(opts, resolved, environ, workdir, workdir)
    assert node.env == {"CUDA_VISIBLE_DEVICES": "3,7"}
    assert _flag(node.argv, "--nproc_per_node") == "2"
    all_devices = resolve_pool(LaunchOptions(user_script="train.py"), environ, device_count=4)
    (node,) = build_plan(opts, all_devices, environ, workdir, workdir)
    assert node.env == {} and _flag(node.argv, "--nproc_per_node") == "4"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-H", "hostfile", "-i", "worker-5", "train.py"], "--include 'worker-5': unknown host"),
        (["-H", "hostfile", "-i", "worker-0", "-e", "worker-1", "train.py"], "mutually exclusive"),
        (["-H", "hostfile", "--num_nodes", "3", "train.py"], "--num_nodes 3 is larger than the 2"),
        (["--nproc", "2"], "missing the training script"),
        (["missing.py"], "script 'missing.py' not found"),
        (["--node_rank", "1", "train.py"], "--node_rank 1 only applies with --no_ssh"),
        (["-H", "hostfile", "--no_ssh", "train.py"], "--no_ssh with 2 nodes needs --node_rank"),
        (["-H", "absent", "train.py"], "-H/--hostfile 'absent': file not found"),
        (["--master_port", "70000", "train.py"], "--master_port must be in 1..65535, got 70000"),
    ],
)
def test_cli_errors_exit_2(workdir: Path, capsys, argv: list[str], expected: str) -> None:
    assert main(["--dry_run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardspeed: error: ") and expected in err


def test_unknown_flag_and_missing_subcommand_exit_2(
    workdir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["--bogus", "train.py"]) == 2
    monkeypatch.setitem(SUBCOMMANDS, "nosuch", ("shardspeed.launcher.nosuch_cmd", "main"))
    assert main(["nosuch", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "subcommand 'nosuch' is not available" in err and "nosuch_cmd is missing" in err


# --- processes --------------------------------------------------------------------------


def test_run_local_returns_child_status() -> None:
    assert run_local([sys.executable, "-c", "raise SystemExit(3)"], {"X": "1"}) == 3


def test_run_remote_prefixes_output_and_stops_others_on_failure(capfd) -> None:
    ok = [sys.executable, "-c", "print('hello')"]
    assert run_remote([("n0", ok, {}), ("n1", ok, {})]) == 0
    out = capfd.readouterr().out
    assert "n0: hello" in out and "n1: hello" in out
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    fail = [sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(4)"]
    start = time.monotonic()
    assert run_remote([("n0", slow, {}), ("n1", fail, {})], grace_s=5.0) == 4
    assert time.monotonic() - start < 10


# --- report -----------------------------------------------------------------------------


def test_collect_report_keys_and_format(capsys) -> None:
    report = collect_report()
    assert set(report) == {"python", "torch", "cuda", "nccl", "gloo", "mpi", "triton", "cpu",
                           "shardspeed", "packages"}  # fmt: skip
    import torch

    assert report["torch"]["version"] == torch.__version__
    assert report["cuda"]["available"] == torch.cuda.is_available()
    assert report["gloo"]["available"] is True
    assert isinstance(report["cpu"]["flags"]["avx2"], bool)
    assert report["cpu"]["logical_cores"] >= 1
    assert set(report["packages"]) >= {"transformers", "safetensors", "deepspeed", "wandb"}
    assert all(isinstance(v, str) for v in report["packages"].values())
    assert report["shardspeed"]["version"]
    text = format_report(report)
    assert "torch version" in text and "optional packages" in text
    assert main(["report", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["torch"]["version"] == torch.__version__
