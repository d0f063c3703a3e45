"""The two-host fixture itself: skip reasons, stale namespaces, and a failing job that must
end within its grace period with nothing left running."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import hosts
import pytest
from hosts import JobFailed, TwoHosts

FAILING_JOB = """
import os, sys, time
print(f"rank {os.environ['RANK']} on host {os.environ['SS_TEST_HOST']}", flush=True)
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(600)  # host A's rank "hangs"; only the runner's kill ends it
"""


def test_unavailable_namespaces_give_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    with pytest.raises(hosts.NamespacesUnavailable, match="needs root"):
        hosts.create_host_pair()
    monkeypatch.setattr(hosts.shutil, "which", lambda name: None)
    with pytest.raises(hosts.NamespacesUnavailable, match="`ip` command"):
        hosts.create_host_pair()


def test_namespaces_of_dead_sessions_are_removed(two_hosts: TwoHosts) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    stale = f"{hosts.PREFIX}B-{dead.pid}"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    try:
        time.sleep(0.2)
        assert stale in hosts.remove_stale_namespaces()
        assert sleeper.wait(timeout=10) != 0  # killed inside the namespace
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in listed
        assert all(h.netns in listed for h in two_hosts.hosts)  # live session kept
    finally:
        hosts.delete_namespace(stale)
        sleeper.kill()


def test_a_failed_host_ends_the_job_within_the_grace_period(
    two_hosts: TwoHosts, tmp_path: Path
) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING_JOB)
    start = time.monotonic()
    with pytest.raises(JobFailed, match=r"exit codes \[-9, 1\]") as err:
        two_hosts.run(script, [], tmp_path, timeout=120, grace=2.0)
    assert time.monotonic() - start < 100
    assert "rank 1 on host B" in str(err.value) and "rank 0 on host A" in str(err.value)
    for host in two_hosts.hosts:
        pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
        assert pids.stdout.split() == [], f"{host.netns} still runs {pids.stdout.split()}"
