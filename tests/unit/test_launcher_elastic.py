"""``shardspeed --elastic``: the per-node torchrun commands and the elastic supervision.

The real elastic runs (a host lost and rejoining) are in ``tests/multinode/``.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

import pytest

from shardspeed.launcher.cli import parse_options
from shardspeed.launcher.elastic import ElasticOptions
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.plan import build_plan, resolve_pool
from shardspeed.launcher.process import run_remote


def _plan(tmp_path: Path, flags: list[str], hostfile: str = "hostA slots=1\nhostB slots=2\n"):
    (tmp_path / "hostfile").write_text(hostfile)
    (tmp_path / "train.py").write_text("")
    argv = ["-H", str(tmp_path / "hostfile"), *flags, str(tmp_path / "train.py"), "--x", "1"]
    _, opts = parse_options(argv)
    assert opts is not None
    return build_plan(opts, resolve_pool(opts, {}), {}, tmp_path, tmp_path)


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_host_runs_an_elastic_agent_with_the_store_on_the_first(tmp_path: Path) -> None:
    nodes = _plan(tmp_path, ["--elastic", "--min_nodes", "1", "--max_restarts", "2",
                             "--rdzv_id", "job7", "--rdzv_conf", "join_timeout=30"])  # fmt: skip
    assert [n.host for n in nodes] == ["hostA", "hostB"]
    for node, is_host, nproc in zip(nodes, ("1", "0"), ("1", "2")):
        argv = node.torchrun_argv
        assert _option(argv, "--nnodes") == "1:2"  # --max_nodes defaults to the hostfile
        assert _option(argv, "--rdzv_backend") == "c10d"
        assert _option(argv, "--rdzv_endpoint") == "hostA:29500"
        assert _option(argv, "--rdzv_id") == "job7"
        conf = _option(argv, "--rdzv_conf")
        assert conf == f"is_host={is_host},join_timeout=30,last_call_timeout=5"
        assert _option(argv, "--local_addr") == node.host
        assert _option(argv, "--max_restarts") == "2"
        assert _option(argv, "--nproc_per_node") == nproc
        assert "--node_rank" not in argv and "--master_addr" not in argv
        assert argv[-3:] == [str(tmp_path / "train.py"), "--x", "1"]
        assert node.remote and shlex.join(argv) in node.argv[-1]  # inside the ssh command
        # each rendezvous round republishes the workers' store address (a host can rejoin)
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in node.argv[-1]


def test_elastic_defaults_and_the_local_machine(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    _, opts = parse_options(["--elastic", str(tmp_path / "train.py")])
    assert opts is not None and opts.elastic == ElasticOptions(1, 1, 3)
    (node,) = build_plan(opts, resolve_pool(opts, {}, device_count=0), {}, tmp_path, tmp_path)
    assert _option(node.argv, "--rdzv_endpoint") == "127.0.0.1:29500"
    assert _option(node.argv, "--local_addr") == "127.0.0.1"
    assert not node.remote


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_nodes", "2"], "--max_nodes only apply with --elastic"),
        (["--elastic", "--min_nodes", "0"], "--min_nodes must be >= 1, got 0"),
        (["--elastic", "--min_nodes", "2", "--max_nodes", "1"], r"--max_nodes \(1\) must be >="),
        (["--elastic", "--min_nodes", "3", "--max_nodes", "4"], "outside --min_nodes 3"),
        (["--elastic", "--rdzv_conf", "is_host=1"], "is_host is set by the launcher"),
        (["--elastic", "--max_restarts", "-1"], "--max_restarts must be >= 0"),
        (["--elastic", "--no_ssh", "--node_rank", "1"], "pass the same --rdzv_id on every node"),
    ],
)
def test_bad_elastic_flags_are_named(tmp_path: Path, flags: list[str], message: str) -> None:
    with pytest.raises(LauncherError, match=message):
        _plan(tmp_path, flags)


def test_elastic_supervision_survives_a_lost_host_and_names_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lost = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    survivor = [sys.executable, "-c", "import time; time.sleep(1.0); print('done')"]
    logger = logging.getLogger("shardspeed")
    logger.addHandler(caplog.handler)
    try:
        status = run_remote([("hostA", survivor, {}), ("hostB", lost, {})], elastic=True)
        assert status == 0  # the job finished on host A
        text = caplog.text
        assert "node hostB lost (status 137); the elastic job continues on hostA" in text
        assert "elastic job finished on hostA; lost host(s): hostB (status 137)" in text
        caplog.clear()
        # without --elastic the first failure ends the job
        assert run_remote([("hostA", survivor, {}), ("hostB", lost, {})]) == 137
        # elastic, and every host failed: the job failed
        assert run_remote([("hostA", lost, {}), ("hostB", lost, {})], elastic=True) == 137
        assert "elastic job failed on no host" in caplog.text
    finally:
        logger.removeHandler(caplog.handler)
