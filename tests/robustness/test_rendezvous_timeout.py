"""A short collective timeout does not fail a job whose ranks start seconds apart.

``init_distributed`` joins the world with its own rendezvous bound (the longer of the
collective timeout and 5 minutes, or ``SHARDSPEED_RENDEZVOUS_TIMEOUT``) and only then gives
the world group the collective timeout. Here the collective timeout is 3 s and rank 1
starts 6 s late: both join; then rank 1 is 6 s late to a collective, and rank 0 times out
after the 3 s (plus the blame grace), not after the rendezvous bound.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from shardspeed.comm.backend import RENDEZVOUS_TIMEOUT_ENV, resolve_rendezvous_timeout

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import shardspeed.comm as comm

    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(6.0)  # starts late
    comm.init_distributed(verbose=False)
    x = torch.ones(4)
    comm.all_reduce(x)
    print(f"rank {rank} joined {float(x[0])}", flush=True)
    if rank == 1:
        time.sleep(6.0)  # late to the next collective
    start = time.monotonic()
    try:
        comm.all_reduce(x)
        print(f"rank {rank} second collective ok", flush=True)
    except Exception as exc:
        print(f"rank {rank} {type(exc).__name__} after {time.monotonic() - start:.1f}s", flush=True)
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_late_rank_joins_but_collectives_keep_the_short_timeout(tmp_path: Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env["SHARDSPEED_COMM_TIMEOUT"] = "3"
    env.pop(RENDEZVOUS_TIMEOUT_ENV, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={port}", str(script)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout
    assert "rank 0 joined 2.0" in out and "rank 1 joined 2.0" in out, done.stderr[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("rank 0 ") and "after" in x)
    assert "CollectiveTimeoutError" in line, line
    assert float(line.rsplit(" ", 1)[1].rstrip("s")) < 5.9, line  # not the 6 s wait it met


def test_rendezvous_timeout_resolution() -> None:
    short, long = timedelta(seconds=3), timedelta(hours=1)
    assert resolve_rendezvous_timeout(short, {}) == timedelta(minutes=5)
    assert resolve_rendezvous_timeout(long, {}) == long
    assert resolve_rendezvous_timeout(short, {RENDEZVOUS_TIMEOUT_ENV: "20"}) == timedelta(
        seconds=20
    )
    for bad in ("soon", "0", "-4"):
        with pytest.raises(ValueError, match=RENDEZVOUS_TIMEOUT_ENV):
            resolve_rendezvous_timeout(short, {RENDEZVOUS_TIMEOUT_ENV: bad})
