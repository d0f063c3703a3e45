"""Orderly process-group teardown when the interpreter exits.

A script that ends without ``destroy_process_group()`` (DeepSpeed's tutorials, most user
scripts) leaves gloo's worker threads alive into interpreter finalisation. A collective's
work object is released on its worker thread *after* the caller's ``wait()`` returns, and
releasing it drops Python-backed tensors, which needs the GIL. If the main thread reaches
``Py_FinalizeEx`` first, that worker thread is told to exit while inside C++ code and the
process dies of ``std::terminate`` ("terminate called without an active exception",
SIGABRT) after the script itself succeeded -- in about one run in five of a short CPU job.

:func:`install` registers an ``atexit`` hook that destroys every process group while the
interpreter is still whole: torch joins the worker threads, and they finish their releases
because the main thread waits with the GIL released. A garbage collection follows, so a
group that only unreachable objects still hold (an engine's checkpoint group, say) is freed
and its threads joined then too, not during finalisation. The destruction runs on a helper
thread joined with a bound (``SHARDSPEED_EXIT_TEARDOWN_TIMEOUT`` seconds, default
:data:`DEFAULT_TIMEOUT_S`), so a collective stuck on a dead peer can delay exit by at most
that much, never hang it. A script that destroys its groups itself is left alone.
"""

from __future__ import annotations

import atexit
import gc
import os
import threading

import torch.distributed as dist

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

TIMEOUT_ENV = "SHARDSPEED_EXIT_TEARDOWN_TIMEOUT"  # seconds; 0 turns the hook off
DEFAULT_TIMEOUT_S = 10.0

_installed = False


def exit_timeout_s() -> float:
    """The bound on exit-time teardown, from :data:`TIMEOUT_ENV` (0 = no teardown)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r} is not a number: set it to the seconds exit may wait "
            "for process-group teardown (0 turns the teardown off), or unset it for "
            f"the default {DEFAULT_TIMEOUT_S:g}."
        ) from None
    if value < 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be >= 0 (0 turns the teardown off).")
    return value


def teardown(timeout_s: float) -> bool:
    """Destroy every process group within ``timeout_s`` seconds; True when done (or none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    failure: list[BaseException] = []

    def destroy() -> None:
        try:
            dist.destroy_process_group()
            # A group that an unreachable object still holds (an engine and its hooks form
            # reference cycles; its checkpoint group ran the script's last collective) keeps
            # its gloo threads after destroy_process_group(); collecting frees it now, while
            # the interpreter is whole, instead of during finalisation.
            gc.collect()
        except BaseException as exc:  # reported by the caller
            failure.append(exc)

    worker = threading.Thread(target=destroy, name="shardspeed-teardown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning(
            "process-group teardown at exit did not finish in %.0f s (a collective is "
            "still in flight); exiting without it (%s sets the bound)",
            timeout_s,
            TIMEOUT_ENV,
        )
        return False
    if failure:
        logger.warning("process-group teardown at exit failed: %s", failure[0])
        return False
    return True


def _at_exit() -> None:
    timeout_s = exit_timeout_s()
    if timeout_s > 0:
        teardown(timeout_s)


def install() -> None:
    """Register the exit-time teardown once (called whenever shardspeed sets up comms)."""
    global _installed
    if _installed:
        return
    exit_timeout_s()  # a malformed setting is an error now, not a surprise at exit
    _installed = True
    atexit.register(_at_exit)
