"""Fault injection through the real ``shardspeed`` launcher: bounded exit and correct blame.

One rank of a gloo job fails in one of four ways after a few tagged collectives: an
uncaught exception, SIGKILL, a hang (alive, never joins) or an early clean exit. The
others wait in the next collective. Every process must be gone within the comm timeout
+ 15 s of the fault, and the launcher's ``shardspeed: job failed`` line must name the
faulty rank first (torchrun's own root cause names a survivor for a hang or an exit).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardspeed.comm.blame import Verdict, summarize, verdict

# The comm timeout also bounds the rendezvous in init_process_group: 4 ranks starting torch on
# 2 busy cores can arrive more than 4 s apart (seen in CI), so it is 8 s, not shorter.
COMM_TIMEOUT_S = 8
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from shardspeed import comm

    fault, bad, stamp = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    comm.init_distributed(dist_backend="gloo", verbose=False)
    rank = comm.get_rank()
    t = torch.ones(4)
    for step in range(3):
        with comm.set_current_tag(f"train.step{step}"):
            comm.all_reduce(t)
    if rank == bad:
        with open(stamp, "w") as f:
            f.write(str(time.time()))
        if fault == "exception":
            raise ValueError("injected fault")
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            time.sleep(600)
        sys.exit(0)  # "exit": leaves early and cleanly
    with comm.set_current_tag("train.step3"):
        comm.all_reduce(t)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _shardspeed_command() -> list[str]:
    script = Path(sys.executable).parent / "shardspeed"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardspeed.launcher.cli"]


def _launch(tmp_path: Path, nproc: int, fault: str, bad: int) -> tuple[str, float, float]:
    """Run the job; (launcher stderr+stdout, seconds from the fault to the end, total)."""
    (tmp_path / "job.py").write_text(SCRIPT)
    stamp = tmp_path / "fault_time"
    env = {
        **os.environ,
        "SHARDSPEED_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "SHARDSPEED_COMM_TIMEOUT": str(COMM_TIMEOUT_S),
    }
    argv = [*_shardspeed_command(), "--nproc", str(nproc), "--master_port", str(_free_port())]
    start = time.time()
    result = subprocess.run(
        [*argv, "job.py", fault, str(bad), str(stamp)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMM_TIMEOUT_S + 60,
    )
    end = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert stamp.exists(), output
    return output, end - float(stamp.read_text()), end - start


CASES = [
    (2, "exception", 1),
    (2, "sigkill", 1),
    (2, "hang", 1),
    (2, "exit", 1),
    (2, "sigkill", 0),
    (4, "exception", 1),
    (4, "sigkill", 3),
    (4, "hang", 2),
    (4, "exit", 2),
]
# Suite time: every fault kind and both world sizes stay in make test (exception and exit on
# 2 ranks, SIGKILL of rank 0 on 2, a hang on 4 ranks: several survivors agreeing); the same
# faults at the other world size, and SIGKILL on 4 ranks, run in make test-slow.
SLOW = {(2, "sigkill", 1), (2, "hang", 1), (4, "exception", 1), (4, "exit", 2), (4, "sigkill", 3)}


@pytest.mark.parametrize(
    ("nproc", "fault", "bad"),
    [pytest.param(*case, marks=[pytest.mark.slow] if case in SLOW else []) for case in CASES],
    ids=[f"{n}r-{f}-r{b}" for n, f, b in CASES],
)
def test_launcher_summary_names_the_faulty_rank(
    tmp_path: Path, nproc: int, fault: str, bad: int
) -> None:
    output, after_fault_s, total_s = _launch(tmp_path, nproc, fault, bad)
    assert after_fault_s < COMM_TIMEOUT_S + 15, (after_fault_s, output)
    assert total_s < COMM_TIMEOUT_S + 40, (total_s, output)
    lines = [line for line in output.splitlines() if line.startswith("shardspeed: job failed")]
    assert len(lines) == 1, output
    found = re.search(r"job failed \(exit status \d+\): (?:rank (\d+))", lines[0])
    assert found is not None and int(found.group(1)) == bad, lines[0]
    assert f"blame: rank {bad} " in output  # the survivors' own reports agree
    if fault == "exception":
        assert "ValueError: injected fault" in lines[0]
    if fault in ("exception", "exit"):
        assert "its last collective was #" in lines[0] and "'train.step2'" in lines[0]
    if fault in ("hang", "sigkill"):
        how = "stopped participating: it is alive" if fault == "hang" else "stopped responding"
        assert how in lines[0]
        assert "never joined #3 all_reduce 'train.step3'" in lines[0]
        assert "its last collective was #2 all_reduce 'train.step2'" in lines[0]


# ----------------------------------------------------------------------- pure parts
def _rec(kind: str, t: float, last: str = "#4 all_reduce 'x'") -> dict[str, object]:
    return {"kind": kind, "time": t, "last": last, "detail": "ValueError: boom"}


def test_verdict_priority_exception_then_exit_then_silence() -> None:
    ranks = [0, 1, 2, 3]
    records = {0: _rec("waiting", 3.0), 2: _rec("exited", 1.0), 3: _rec("exception", 2.0)}
    assert verdict(0, ranks, records, 2.0).culprit == 3
    del records[3]
    assert verdict(0, ranks, records, 2.0).culprit == 2
    del records[2]
    silent = verdict(0, ranks, records, 2.0)
    assert silent.culprit == 1 and "also silent: ranks [2, 3]" in silent.text
    records[2] = _rec("alive", 1.0)  # blocked in the same collective: not to blame
    assert verdict(0, ranks, records, 2.0).culprit == 1
    records[1] = _rec("alive", 1.0, "#3 all_reduce 'x'")  # alive but behind
    assert verdict(0, ranks, records, 2.0).culprit == 1
    assert "alive but never joined" in verdict(0, ranks, records, 2.0).text
    everyone = {r: _rec("waiting", 1.0, f"#{r} all_reduce") for r in ranks}
    assert verdict(0, ranks, everyone, 2.0).culprit is None


def test_summarize_prefers_agreed_verdicts_then_exceptions() -> None:
    verdicts = [
        {"rank": 0, "kind": "verdict", "culprit": 2, "text": "rank 2 stopped", "time": 5.0},
        {"rank": 1, "kind": "verdict", "culprit": 2, "text": "rank 2 stopped", "time": 5.1},
    ]
    exception = {"rank": 3, "kind": "exception", "time": 1.0, "detail": "E: x", "last": "#1"}
    assert summarize(verdicts + [exception]) == "rank 2 stopped (reported by rank(s) [0, 1])"
    assert summarize([exception]) == "rank 3 failed: E: x; its last collective was #1"
    assert summarize([]) is None
    assert isinstance(verdict(0, [0], {0: _rec("waiting", 1.0)}, 1.0), Verdict)
