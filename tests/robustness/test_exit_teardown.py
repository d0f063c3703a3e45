"""A script that ends without destroy_process_group() exits 0, not SIGABRT.

gloo releases a finished collective's work object on its worker thread, after ``wait()``
returns; that release needs the GIL. A script that exits right after its last collective
used to reach interpreter finalisation first and die of ``std::terminate`` ("terminate
called without an active exception") in about 7 of 10 runs of the script below (and one in
five of DeepSpeed's CIFAR-10 tutorial, which failed CI; with torch 2.13 on 2 busy cores, in
about 1 of 4 launches of 4 ranks and fewer of 2). ``shardspeed.comm.teardown``
destroys the groups at exit while the interpreter is whole.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardspeed.comm import teardown

REPO = Path(__file__).resolve().parents[2]

RACE = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import shardspeed.comm as comm

    comm.init_distributed(verbose=False)
    x = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(x, async_op=True).wait()
    print(f"rank {dist.get_rank()} done {float(x[0])}", flush=True)  # one write: no interleaving
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_script_ending_right_after_a_collective_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "race.py"
    script.write_text(RACE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop(teardown.TIMEOUT_ENV, None)
    # 8 exits, as 2 launches of 4 ranks (fewer torchrun agents than 4 launches of 2): 4 ranks
    # on a 2-core box also make the race likelier, 2 of 8 such launches died of it with the
    # teardown off (SHARDSPEED_EXIT_TEARDOWN_TIMEOUT=0) where 8 launches of 2 ranks showed none;
    # 2 launches (suite time) catch a return of the race with probability ~0.44 per run
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
               f"--master_port={_free_port()}", str(script)]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "terminate called" not in done.stderr
        for rank in range(4):
            assert f"rank {rank} done 64.0" in done.stdout, done.stdout


def test_teardown_destroys_the_groups_and_is_idempotent() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert teardown.teardown(5.0) is True
        assert not dist.is_initialized()
        assert teardown.teardown(5.0) is True  # nothing left: still fine
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_teardown_frees_a_group_held_by_unreachable_objects() -> None:
    """An engine sits in reference cycles and holds subgroups (its checkpoint group): after
    the teardown their gloo threads are gone, not left for interpreter finalisation."""
    import torch
    import torch.distributed as dist

    def threads() -> set[str]:  # this process's thread ids (other tests' may come and go)
        return set(os.listdir(f"/proc/{os.getpid()}/task"))

    before = threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:

        class Holder:  # an engine-like cycle holding a group that ran the last collective
            def __init__(self) -> None:
                self.group, self.me = dist.new_group([0]), self

        holder = Holder()
        dist.all_reduce(torch.ones(4), group=holder.group)
        del holder
        started = threads() - before  # the groups' gloo threads
        assert started
        assert teardown.teardown(5.0) is True
        assert not started & threads()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_bad_timeout_setting_is_named(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(teardown.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=teardown.TIMEOUT_ENV):
        teardown.exit_timeout_s()


def test_timeout_setting_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(teardown.TIMEOUT_ENV, "0")
    assert teardown.exit_timeout_s() == 0.0
    monkeypatch.delenv(teardown.TIMEOUT_ENV)
    assert teardown.exit_timeout_s() == teardown.DEFAULT_TIMEOUT_S
