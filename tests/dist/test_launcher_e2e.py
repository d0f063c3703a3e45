"""End to end: the real ``shardspeed`` command launches gloo ranks through torchrun.

The multi-node test puts a fake ``ssh`` on PATH that runs the remote command locally, so
two "hosts" from a hostfile become two torchrun agents on this machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    import torch
    import torch.distributed as dist

    assert sys.argv[1].startswith("--local_rank="), sys.argv
    local_rank = int(sys.argv[1].split("=", 1)[1])
    assert local_rank == int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == sum(range(world)), total
    out = os.path.join(sys.argv[2], f"rank{rank}.txt")
    with open(out, "w") as f:
        f.write(f"{rank} {world} {total.item():.0f} {sys.argv[1]} {sys.argv[3]}")
    if "MY_VAR" in os.environ:
        print(f"rank {rank} MY_VAR={os.environ['MY_VAR']}", flush=True)
    dist.destroy_process_group()
    """
)


FAKE_SSH = """#!/bin/sh
# fake ssh: drop [-p PORT] HOST, run the remote command here
while [ $# -gt 1 ]; do shift; done
exec /bin/sh -c "$1"
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _shardspeed_command() -> list[str]:
    script = Path(sys.executable).parent / "shardspeed"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "shardspeed.launcher.cli"]


def test_shardspeed_launches_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {**os.environ, "SHARDSPEED_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    argv = [*_shardspeed_command(), "--nproc", "2", "--master_port", str(_free_port())]
    result = subprocess.run(
        [*argv, str(script), str(out_dir), "extra-arg"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        fields = (out_dir / f"rank{rank}.txt").read_text().split()
        assert fields == [str(rank), "2", "1", f"--local_rank={rank}", "extra-arg"]


def test_shardspeed_multi_node_over_fake_ssh(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    (tmp_path / "hostfile").write_text("nodeA slots=1\nnodeB slots=1\n")
    (tmp_path / ".shardspeed_env").write_text("MY_VAR=from_env_file\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(tmp_path),
        "SHARDSPEED_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    argv = [*_shardspeed_command(), "-H", "hostfile", "--master_addr", "127.0.0.1"]
    argv += ["--master_port", str(_free_port())]
    result = subprocess.run(
        [*argv, "train.py", str(out_dir), "multi"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        fields = (out_dir / f"rank{rank}.txt").read_text().split()
        assert fields == [str(rank), "2", "1", "--local_rank=0", "multi"]
    lines = result.stdout.splitlines()
    assert "nodeA: rank 0 MY_VAR=from_env_file" in lines
    assert "nodeB: rank 1 MY_VAR=from_env_file" in lines
