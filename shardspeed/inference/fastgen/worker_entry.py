"""The common start and stop of spawned FastGen workers (tensor, pipeline or expert parallel).

Each multi-process engine keeps rank 0 in the caller's process and spawns the other ranks;
every spawned worker runs its own serve loop inside :func:`run_worker`, which ignores
Ctrl-C (rank 0 handles it), ends quietly when rank 0 closes the pipe, and reports any other
failure to rank 0 with its traceback before exiting with status 1.
"""

from __future__ import annotations

import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch

A = TypeVar("A")


def run_worker(
    serve: Callable[[Connection, A], None], conn: Connection, args: A, error_tag: str
) -> None:
    """Run ``serve(conn, args)``; returns when rank 0 says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    try:
        serve(conn, args)
    except EOFError:  # rank 0 closed its end (exited or dropped the engine)
        return
    except BaseException:
        try:
            conn.send((error_tag, traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None


def worker_device(num_threads: int, device: str) -> torch.device:
    """Set this worker's torch threads and (CUDA) current device; the device it runs on."""
    torch.set_num_threads(num_threads)
    out = torch.device(device)
    if out.type == "cuda":
        torch.cuda.set_device(out)
    return out


STOP_TIMEOUT_S = 5.0  # a worker asked to stop is terminated after this


def stop_workers(procs: list[BaseProcess], conns: list[Connection], stop_tag: str) -> None:
    """Rank 0's side: ask each worker to stop, then terminate (and kill) those that do not."""
    for conn in conns:
        try:
            conn.send((stop_tag, None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()


def await_replies(
    workers: list[tuple[str, BaseProcess, Connection]],
    expected: str,
    timeout_s: float,
    fail: Callable[[str], Exception],
) -> list[object]:
    """Each worker's next ``(kind, payload)`` message, which must be ``expected``; payloads
    in order. ``fail(reason)`` builds the raised error when a worker exits, stays silent
    for ``timeout_s`` (one deadline for all), reports an error (``"error"``, its
    traceback) or sends another kind."""
    deadline = time.monotonic() + timeout_s
    payloads = []
    for name, proc, conn in workers:
        while not conn.poll(0.05):
            if not proc.is_alive() and not conn.poll(0):
                raise fail(f"{name} exited (code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise fail(f"{name} sent no {expected!r} in {timeout_s:g} s")
        kind, payload = conn.recv()
        if kind == "error":
            raise fail(f"{name} failed:\n{payload}")
        if kind != expected:
            raise fail(f"{name} sent {kind!r}, not {expected!r}")
        payloads.append(payload)
    return payloads
