"""The common start of a spawned FastGen worker (tensor, pipeline or expert parallel).

Each multi-process engine keeps rank 0 in the caller's process and spawns the other ranks;
every spawned worker runs its own serve loop inside :func:`run_worker`, which ignores
Ctrl-C (rank 0 handles it), ends quietly when rank 0 closes the pipe, and reports any other
failure to rank 0 with its traceback before exiting with status 1.
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
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
