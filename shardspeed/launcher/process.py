"""Running the plan: one local torchrun, or one ssh/pdsh process per remote node.

Exit codes always propagate: the launcher returns torchrun's status locally and, for a
multi-node job, the status of the first node that failed (a signal-killed child maps to
``128 + signal``). When a node fails, the others are terminated. A failed local job ends
with one ``shardspeed: job failed`` line naming the first rank that failed and why.

An elastic job (``elastic=True``) keeps going when a node's process ends with an error: that
host is lost, and the other nodes' agents carry on without it (torchrun restarts their
workers at the smaller world). The job's status is that of the nodes still running at the
end (0 when they all succeed), and a ``shardspeed: elastic job`` summary names every lost
host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO

from shardspeed.utils.logging import get_logger

BLAME_DIR_ENV = "SHARDSPEED_BLAME_DIR"  # shardspeed.comm.blame reads it (kept torch-free here)

logger = get_logger(__name__)

_FORWARDED = (signal.SIGINT, signal.SIGTERM)


def exit_status(returncode: int) -> int:
    """A shell-style status: negative (killed by signal N) becomes ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode


@contextlib.contextmanager
def _handle_signals(handler: Callable[[int, object], None]) -> Iterator[None]:
    """Install ``handler`` for SIGINT/SIGTERM (main thread only) and restore afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in _FORWARDED}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _terminal_signals_group() -> bool:
    """Whether a terminal Ctrl-C reaches our whole process group (children included)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def failure_summary(status: int, blame_dir: str) -> str:
    """The launcher's one line for a failed job: the first rank that failed, and why.

    Read from the records the ranks left in ``blame_dir`` (see
    :mod:`shardspeed.comm.blame`); torchrun's own "root cause" can name a survivor.
    """
    from shardspeed.comm.blame import read_records, summarize

    found = summarize(read_records(blame_dir))
    if found is None:
        found = "no rank left a failure report (see torchrun's output above)"
    return f"shardspeed: job failed (exit status {status}): {found}"


def run_local(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``argv`` (a torchrun command) with ``env`` added, forwarding SIGINT/SIGTERM.

    The child stays in our process group, so a terminal Ctrl-C already reaches it; SIGINT
    is forwarded only when it cannot have come from the terminal. When the job fails, one
    line on stderr names the first rank that failed (:func:`failure_summary`).
    """
    with tempfile.TemporaryDirectory(prefix="shardspeed-blame-") as blame_dir:
        status = _run_local(argv, {**env, BLAME_DIR_ENV: blame_dir})
        if status != 0:
            sys.stderr.write(failure_summary(status, blame_dir) + "\n")
            sys.stderr.flush()
    return status


def _run_local(argv: Sequence[str], env: Mapping[str, str]) -> int:
    proc = subprocess.Popen(list(argv), env={**os.environ, **env})

    def forward(signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and _terminal_signals_group():
            return
        if proc.poll() is None:
            proc.send_signal(signum)

    with _handle_signals(forward):
        returncode = proc.wait()
    return exit_status(returncode)


def _pump(stream: IO[str], prefix: str, lock: threading.Lock) -> None:
    """Copy ``stream`` to our stdout line by line, each line prefixed."""
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(prefix + line if line.endswith("\n") else f"{prefix}{line}\n")
            sys.stdout.flush()
    stream.close()


def _terminate(procs: Sequence[subprocess.Popen[str]], grace_s: float) -> None:
    """SIGTERM every live process, then SIGKILL what is left after ``grace_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_remote(
    commands: Sequence[tuple[str, Sequence[str], Mapping[str, str]]],
    *,
    prefix_output: bool = True,
    poll_interval_s: float = 0.1,
    grace_s: float = 10.0,
    elastic: bool = False,
) -> int:
    """Start one process per ``(host, argv, env)`` and stream their output as ``host: line``.

    Returns 0 when every node exits 0. When one fails, the others are terminated and its
    status is returned; SIGINT/SIGTERM terminate all and return ``128 + signal``. With
    ``elastic`` a failed node is reported lost and the others run on (module docstring).
    """
    lock = threading.Lock()
    procs: list[subprocess.Popen[str]] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    with _handle_signals(on_signal):
        for host, argv, env in commands:
            proc = subprocess.Popen(
                list(argv),
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                bufsize=1,
            )
            procs.append(proc)
            prefix = f"{host}: " if prefix_output else ""
            pump = threading.Thread(target=_pump, args=(proc.stdout, prefix, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        hosts = [host for host, _, _ in commands]
        if elastic:
            status = _supervise_elastic(hosts, procs, received, poll_interval_s)
        else:
            status = _supervise(hosts, procs, received, poll_interval_s)
        _terminate(procs, grace_s)
    for pump in pumps:
        pump.join(timeout=5.0)
    return status


def _supervise(
    hosts: list[str],
    procs: list[subprocess.Popen[str]],
    received: list[int],
    poll_interval_s: float,
) -> int:
    """Wait until all succeed, one fails, or a signal arrives; return the job's status."""
    while True:
        if received:
            logger.warning("received signal %d; terminating all %d nodes", received[0], len(procs))
            return 128 + received[0]
        codes = [proc.poll() for proc in procs]
        for host, code in zip(hosts, codes):
            if code is not None and code != 0:
                others = sum(c is None for c in codes)
                logger.error(
                    "node %s exited with status %d; terminating the %d node(s) still running",
                    host,
                    exit_status(code),
                    others,
                )
                return exit_status(code)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(poll_interval_s)


def _supervise_elastic(
    hosts: list[str],
    procs: list[subprocess.Popen[str]],
    received: list[int],
    poll_interval_s: float,
) -> int:
    """Wait for every node; a node that fails is lost, not the end of the job."""
    lost: dict[str, int] = {}
    while True:
        if received:
            logger.warning("received signal %d; terminating all %d nodes", received[0], len(procs))
            return 128 + received[0]
        codes = [proc.poll() for proc in procs]
        for host, code in zip(hosts, codes):
            if code not in (None, 0) and host not in lost:
                lost[host] = exit_status(code)
                running = [h for h, c in zip(hosts, codes) if c is None]
                logger.warning(
                    "node %s lost (status %d); the elastic job continues on %s",
                    host,
                    lost[host],
                    ", ".join(running) or "no node",
                )
        if all(code is not None for code in codes):
            break
        time.sleep(poll_interval_s)
    finished = [h for h, c in zip(hosts, codes) if c == 0]
    status = 0 if finished else max(lost.values())
    lost_text = ", ".join(f"{h} (status {s})" for h, s in lost.items()) or "none"
    (logger.warning if lost else logger.info)(
        "shardspeed: elastic job %s on %s; lost host(s): %s",
        "finished" if finished else "failed",
        ", ".join(finished) or "no host",
        lost_text,
    )
    return status
