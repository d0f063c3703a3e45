"""Two hosts on one machine: network namespaces joined by a veth pair, one torchrun agent each.

::

    host A  netns ss-hostA-<pid>   veth ssA<pid>  10.231.0.1/24   c10d rendezvous store
       |                                  |
       +-------------- veth pair ---------+
       |                                  |
    host B  netns ss-hostB-<pid>   veth ssB<pid>  10.231.0.2/24

Each namespace has its own loopback and its own address; the only route between them is
the veth link, so every byte of the rendezvous, the c10d store and gloo crosses it. Both
see the machine's filesystem (a shared folder, as NFS or Lustre would give real hosts).
The names carry the pytest process id, so concurrent sessions do not collide, and the
namespaces of a session that died (its pid gone) are removed by the next one.

A job is ``torchrun`` in each namespace (``ip netns exec``) with the c10d rendezvous on
host A's address, gloo bound to the namespace's veth (``GLOO_SOCKET_IFNAME``) and a
deadline: on a failure or a timeout every process inside both namespaces is SIGKILLed, so
a broken job never hangs the suite.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "ss-host"
_STALE = re.compile(rf"^{PREFIX}[AB]-(\d+)$")
SUBNET = "10.231.0"
REPO = Path(__file__).resolve().parents[2]


class NamespacesUnavailable(RuntimeError):
    """This machine cannot create network namespaces (the tests skip with this reason)."""


@dataclass(frozen=True)
class Host:
    label: str  # "A" / "B"
    netns: str
    ifname: str  # the namespace's end of the veth pair
    addr: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(netns: str) -> None:
    """SIGKILL every process whose network namespace is ``netns``."""
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def delete_namespace(netns: str) -> None:
    """Kill what runs inside, then delete (the veth end goes with it, and so its peer)."""
    kill_namespace_processes(netns)
    _ip("netns", "del", netns, check=False)


def remove_stale_namespaces() -> list[str]:
    """Delete ``ss-host{A,B}-<pid>`` namespaces whose pytest process no longer exists."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _STALE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            delete_namespace(name)
            removed.append(name)
    return removed


def create_host_pair() -> tuple[Host, Host]:
    """Create the two namespaces and their veth link; raise :class:`NamespacesUnavailable`
    (fast) where namespaces cannot be made here, ``RuntimeError`` on any later failure."""
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise NamespacesUnavailable("creating network namespaces needs root")
    remove_stale_namespaces()
    pid = os.getpid()
    a = Host("A", f"{PREFIX}A-{pid}", f"ssA{pid}", f"{SUBNET}.1")
    b = Host("B", f"{PREFIX}B-{pid}", f"ssB{pid}", f"{SUBNET}.2")
    first = _ip("netns", "add", a.netns, check=False)
    if first.returncode != 0:
        raise NamespacesUnavailable(f"`ip netns add` failed: {first.stderr.strip()}")
    try:
        _ip("netns", "add", b.netns)
        _ip("link", "add", a.ifname, "netns", a.netns, "type", "veth",
            "peer", "name", b.ifname, "netns", b.netns)  # fmt: skip
        for host in (a, b):
            _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
    except BaseException:
        destroy_host_pair((a, b))
        raise
    return a, b


def destroy_host_pair(hosts: tuple[Host, Host]) -> None:
    for host in hosts:
        delete_namespace(host.netns)


class JobFailed(AssertionError):
    """A two-host job exited non-zero or ran past its deadline; the message has the logs."""


@dataclass
class TwoHosts:
    """The session's host pair and a runner for ``torchrun`` jobs across it."""

    a: Host
    b: Host
    rdzv_port: int = 29400  # inside the namespaces: no other process can hold it
    jobs_started: int = 0

    @property
    def hosts(self) -> tuple[Host, Host]:
        return (self.a, self.b)

    def torchrun_argv(
        self, host: Host, script: Path, args: list[str], nproc: int, job: int
    ) -> list[str]:
        """Host ``host``'s agent for job number ``job``: c10d rendezvous on host A."""
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc_per_node", str(nproc),
            "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"{self.a.addr}:{self.rdzv_port + job}",
            "--rdzv_id", f"ss-{os.getpid()}-{job}",
            # torch decides "am I the store host" from the machine's hostname, which a
            # namespace does not change: say it; join_timeout bounds a missing peer
            "--rdzv_conf", f"is_host={int(host is self.a)},join_timeout=60",
            "--local_addr", host.addr,  # MASTER_ADDR for the workers = rank 0's address
            "--max_restarts", "0",
            str(script), *args,
        ]  # fmt: skip

    def agent_env(self, host: Host, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        paths = [str(REPO), str(REPO / "tests" / "dist"), str(Path(__file__).parent)]
        env.update(
            PYTHONPATH=os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            GLOO_SOCKET_IFNAME=host.ifname,
            SHARDSPEED_ACCELERATOR="cpu",
            CUDA_VISIBLE_DEVICES="",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            # a lost peer surfaces as an error well inside the job deadline
            SHARDSPEED_COMM_TIMEOUT="60",
            SHARDSPEED_RENDEZVOUS_TIMEOUT="60",
            SS_TEST_HOST=host.label,
        )
        env.update(extra or {})
        return env

    def run(
        self,
        script: Path,
        args: list[str],
        log_dir: Path,
        *,
        nproc: int = 1,
        timeout: float = 240.0,
        grace: float = 15.0,
        env: dict[str, str] | None = None,
    ) -> float:
        """Run ``script`` on both hosts; return the wall time. Raise :class:`JobFailed`.

        ``grace``: once one agent has failed, how long the other may take to notice.
        """
        self.jobs_started += 1
        logs = [log_dir / f"agent_{h.label}.log" for h in self.hosts]
        procs: list[subprocess.Popen[bytes]] = []
        start = time.monotonic()
        timed_out = False
        try:
            for host, log in zip(self.hosts, logs):
                argv = ["ip", "netns", "exec", host.netns,
                        *self.torchrun_argv(host, script, args, nproc, self.jobs_started)]  # fmt: skip
                with open(log, "wb") as out:
                    procs.append(
                        subprocess.Popen(
                            argv,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            env=self.agent_env(host, env),
                            cwd=log_dir,
                            start_new_session=True,
                        )
                    )
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if now - start > timeout or (failed_at is not None and now - failed_at > grace):
                    timed_out = now - start > timeout
                    break
                time.sleep(0.1)
        finally:
            self._kill(procs)
        wall = time.monotonic() - start
        codes = [p.returncode for p in procs]
        if timed_out or codes != [0, 0]:
            what = f"timed out after {timeout:.0f} s" if timed_out else f"exit codes {codes}"
            tails = "\n".join(
                f"--- host {h.label} ({h.netns}) {log} ---\n{_tail(log)}"
                for h, log in zip(self.hosts, logs)
            )
            raise JobFailed(f"two-host job {script.name} {what} (wall {wall:.1f} s)\n{tails}")
        return wall

    def _kill(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Nothing of the job survives: its process groups, then anything in the namespaces."""
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for host in self.hosts:
            kill_namespace_processes(host.netns)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _tail(path: Path, num_chars: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"(no log: {err})"
    return text[-num_chars:]


def launcher_env(pair: TwoHosts, tmp: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``python -m shardspeed.launcher`` reaching the two hosts over the
    fake ``ssh`` (``fake_ssh.sh``, first on ``PATH``); calls are logged to ``tmp/ssh.log``."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).parent / "fake_ssh.sh", bin_dir / "ssh")
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(REPO / "tests" / "dist"), str(Path(__file__).parent)]
        ),  # fmt: skip
        "SS_FAKE_SSH_HOSTS": ";".join(
            f"{h.addr}={h.netns}:{h.ifname}:{h.label}" for h in pair.hosts
        ),
        "SS_FAKE_SSH_LOG": str(tmp / "ssh.log"),
        "SHARDSPEED_ACCELERATOR": "cpu",
        "SHARDSPEED_COMM_TIMEOUT": "60",
        "SHARDSPEED_RENDEZVOUS_TIMEOUT": "60",
        **(extra or {}),
    }


def write_hostfile(pair: TwoHosts, tmp: Path) -> Path:
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"{h.addr} slots=1\n" for h in pair.hosts))
    return hostfile
