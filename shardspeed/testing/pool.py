"""Warm worker pools behind :func:`run_distributed`.

Starting a rank costs an interpreter plus ``import torch`` (seconds on a small CI box);
a test suite with a hundred multi-process tests cannot pay that per test. So each world
size gets a pool of ``world_size`` processes, forked from a forkserver that has torch
preloaded, and reused for every call. Each call joins a *fresh* process group through a
per-call prefix of one TCP store hosted by this (parent) process, and the group is destroyed
afterwards. A pool that saw a failure or a timeout is killed and respawned on the next call,
so no call inherits a broken rank.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from shardspeed.testing import _worker

_STORE_HOST = "127.0.0.1"
_ERROR_GRACE_S = 0.5  # after the first failure, how long to collect other ranks' reports
_DUMP_WAIT_S = 2.0  # on timeout, how long to wait for stack dumps
_OUTPUT_TAIL = 4000


class DistributedTestError(RuntimeError):
    """One or more ranks failed (or hung) inside :func:`run_distributed`.

    ``failures`` maps rank -> remote traceback (or diagnosis) text.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class DistributedTestTimeout(DistributedTestError):
    """Some ranks did not finish within the timeout; ``failures`` holds their diagnosis."""


def _mp_context() -> mp.context.BaseContext:
    method = os.environ.get("SHARDSPEED_TEST_START_METHOD", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(
            f"SHARDSPEED_TEST_START_METHOD={method!r} is not supported; use 'forkserver' "
            "(default, fast) or 'spawn'."
        )
    ctx = mp.get_context(method)
    if method == "forkserver":
        # _preload: shardspeed's engine and transformers' model classes, imported once by
        # the server instead of by every rank of every pool start (see that module)
        preload = ["torch", "torch.distributed", "shardspeed.testing._worker"]
        if os.environ.get("SHARDSPEED_TEST_PRELOAD", "1") != "0":
            preload.append("shardspeed.testing._preload")
        ctx.set_forkserver_preload(preload)
    return ctx


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Keep multiprocessing from re-running the parent's ``__main__`` in each worker.

    Workers never need it (``fn`` from ``__main__`` is rejected), and hiding it lets a plain
    script call :func:`run_distributed` without an ``if __name__ == "__main__"`` guard.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__.pop(k) for k in ("__file__",) if main and k in main.__dict__}
    saved_spec = getattr(main, "__spec__", None)
    if main is not None:
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            main.__spec__ = saved_spec


def _tail(path: str, limit: int = _OUTPUT_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return ("...\n" if size > limit else "") + text


class WorkerPool:
    """``world_size`` warm processes that run one distributed call at a time."""

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self._store = dist.TCPStore(
            _STORE_HOST, 0, None, True, timedelta(seconds=60), wait_for_workers=False
        )
        self.port: int = self._store.port
        self._tmpdir = tempfile.mkdtemp(prefix=f"shardspeed-pool{world_size}-")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._ctrls: list[Any] = []
        self._call_id = 0

    # ----------------------------------------------------------------- lifecycle
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        ctx = _mp_context()
        for rank in range(self.world_size):
            task_parent, task_child = ctx.Pipe(duplex=True)
            ctrl_parent, ctrl_child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker.worker_main,
                args=(rank, task_child, ctrl_child),
                name=f"shardspeed-rank{rank}",
                daemon=True,
            )
            with _main_module_hidden():
                proc.start()
            task_child.close()
            ctrl_child.close()
            self._procs.append(proc)
            self._tasks.append(task_parent)
            self._ctrls.append(ctrl_parent)

    def kill(self) -> None:
        """SIGKILL every worker (used after failures; the next call respawns)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5)
        for conn in (*self._tasks, *self._ctrls):
            conn.close()
        self._procs, self._tasks, self._ctrls = [], [], []

    def close(self) -> None:
        """Ask workers to exit, kill stragglers, drop the store and the temp dir."""
        for conn in self._tasks:
            try:
                conn.send(("exit",))
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._store = None

    # ----------------------------------------------------------------- one call
    def _log_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir, f"rank{rank}.log")

    def run(
        self,
        payload: bytes,
        timeout: float,
        backend: str,
        rewrite_modules: list[tuple[str, str]] | None = None,
    ) -> tuple[list[Any], list[str | None]]:
        """Run a pickled ``(fn, args, kwargs)`` on every rank; returns (results, skips)."""
        __tracebackhide__ = True
        if not self.alive:
            self.kill()
            self._start()
        self._call_id += 1
        base_env = dict(os.environ)
        for rank, conn in enumerate(self._tasks):
            env = dict(base_env)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(self.world_size),
                LOCAL_WORLD_SIZE=str(self.world_size),
                MASTER_ADDR=_STORE_HOST,
                MASTER_PORT=str(self.port),
                SHARDSPEED_TEST_WORKER="1",
            )
            spec = {
                "call_id": self._call_id,
                "world_size": self.world_size,
                "backend": backend,
                "store_host": _STORE_HOST,
                "store_port": self.port,
                "pg_timeout_s": timeout + 30.0,
                "sys_path": list(sys.path),
                "cwd": os.getcwd(),
                "rewrite_modules": rewrite_modules or [],
                "env": env,
                "payload": payload,
                "log_path": self._log_path(rank),
            }
            conn.send(("run", spec))
        try:
            return self._collect(timeout)
        except DistributedTestError:
            raise  # _collect already killed the pool
        except BaseException:
            self.kill()  # e.g. KeyboardInterrupt: workers are mid-call, never reuse them
            raise

    def _collect(self, timeout: float) -> tuple[list[Any], list[str | None]]:
        __tracebackhide__ = True
        results: list[Any] = [None] * self.world_size
        skips: list[str | None] = [None] * self.world_size
        failures: dict[int, str] = {}
        returned: set[int] = set()
        pending = {conn: rank for rank, conn in enumerate(self._tasks)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if failures or any(skips):  # peers may now block forever: short grace only
                deadline = min(deadline, now + _ERROR_GRACE_S)
            remaining = deadline - now
            if remaining <= 0:
                break
            ready = mp_connection.wait([*pending, *sentinels], timeout=remaining)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self._tasks[rank]
                    if conn in pending and not conn.poll():
                        del pending[conn]
                        failures[rank] = self._death_report(rank)
                    continue
                rank = pending.pop(obj)
                try:
                    status, _, body, _ = obj.recv()
                except (EOFError, OSError):
                    failures[rank] = self._death_report(rank)
                    continue
                if status == "returned":
                    returned.add(rank)
                    pending[obj] = rank
                elif status == "ok":
                    results[rank] = pickle.loads(body)
                elif status == "skip":
                    skips[rank] = body
                else:
                    failures[rank] = f"{body}{self._output_section(rank)}"
        if failures:
            self.kill()
            raise DistributedTestError(_format_failures(failures, self.world_size), failures)
        if any(skips):
            self.kill()  # skipped ranks left their process group (and maybe peers) behind
            return results, skips
        if pending:
            unfinished = sorted(pending.values())
            diagnosis = self._diagnose(unfinished)
            self.kill()
            hung = [r for r in unfinished if r not in returned]
            waiting = [r for r in unfinished if r in returned]
            raise DistributedTestTimeout(
                _format_timeout(hung, waiting, timeout, diagnosis, self.world_size), diagnosis
            )
        return results, skips

    def _output_section(self, rank: int) -> str:
        out = _tail(self._log_path(rank)).strip()
        return f"\n--- rank {rank} output (tail) ---\n{out}" if out else ""

    def _death_report(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return f"rank {rank} process exited unexpectedly (exit code {proc.exitcode}).{self._output_section(rank)}"

    def _diagnose(self, ranks: list[int]) -> dict[int, str]:
        """Ask hung ranks for their main-thread stack and recent collectives."""
        for rank in ranks:
            try:
                self._ctrls[rank].send("dump")
            except OSError:
                pass
        report: dict[int, str] = {}
        deadline = time.monotonic() + _DUMP_WAIT_S
        for rank in ranks:
            conn = self._ctrls[rank]
            text = "no response to the stack-dump request"
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    dump = conn.recv()
                    ops = dump.get("recent_ops") or []
                    ops_text = "\n".join(f"  {op}" for op in ops[-8:]) or "  (none recorded)"
                    text = (
                        f"main thread stack:\n{dump['stack']}"
                        f"last collectives issued (oldest first):\n{ops_text}"
                    )
            except (EOFError, OSError):
                pass
            report[rank] = text + self._output_section(rank)
        return report


def _format_failures(failures: dict[int, str], world_size: int) -> str:
    ranks = sorted(failures)
    parts = [f"{len(ranks)} of {world_size} ranks failed (ranks {ranks}):"]
    for rank in ranks:
        parts.append(f"\n===== rank {rank} =====\n{failures[rank].rstrip()}")
    return "\n".join(parts)


def _format_timeout(
    hung: list[int], waiting: list[int], timeout: float, diagnosis: dict[int, str], ws: int
) -> str:
    head = f"timed out after {timeout:.1f}s: ranks {hung} of {ws} had not finished fn"
    if waiting:
        head += f" (ranks {waiting} had returned and were waiting for them in the final barrier)"
    parts = [head + "; all ranks were killed. Raise `timeout=` if the test is just slow."]
    for rank in sorted(diagnosis):
        state = "returned, waiting" if rank in waiting else "hung in fn"
        parts.append(f"\n===== rank {rank} ({state}) =====\n{diagnosis[rank].rstrip()}")
    return "\n".join(parts)


# --------------------------------------------------------------------- pool registry
_POOLS: dict[int, WorkerPool] = {}
_LOCK = threading.Lock()


def get_pool(world_size: int) -> WorkerPool:
    """The warm pool for ``world_size`` ranks (created on first use).

    At most ``SHARDSPEED_TEST_MAX_POOLS`` (default 3) pools stay warm; the least recently
    used one is closed to make room, bounding idle processes and memory.
    """
    pool = _POOLS.pop(world_size, None)
    if pool is None:
        max_pools = max(1, int(os.environ.get("SHARDSPEED_TEST_MAX_POOLS", "3")))
        while len(_POOLS) >= max_pools:
            oldest = next(iter(_POOLS))
            _POOLS.pop(oldest).close()
        pool = WorkerPool(world_size)
    _POOLS[world_size] = pool  # dicts keep insertion order: most recent last
    return pool


def shutdown_pools() -> None:
    """Stop every warm worker pool (safe to call twice; registered with atexit)."""
    with _LOCK:
        while _POOLS:
            _, pool = _POOLS.popitem()
            pool.close()


atexit.register(shutdown_pools)


def _assert_rewritten_modules(fn: Callable[..., Any]) -> list[tuple[str, str]]:
    """``fn``'s module if pytest rewrote its asserts here, so workers can do the same."""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    loader = getattr(module, "__loader__", None)
    path = getattr(module, "__file__", None)
    if module is None or path is None or type(loader).__name__ != "AssertionRewritingHook":
        return []
    return [(module.__name__, path)]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result by rank.

    ``torch.distributed`` is initialised before ``fn`` runs (so
    ``shardspeed.comm.init_distributed()`` is a no-op) and destroyed after; the environment
    has RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and torch uses one
    thread (``SHARDSPEED_TEST_NUM_THREADS`` overrides). ``fn`` must be importable (defined at
    module level) and its arguments and return value picklable. Any failing rank raises
    :class:`DistributedTestError` with every failing rank's remote traceback and output;
    ranks still running after ``timeout`` seconds raise :class:`DistributedTestTimeout`
    naming them, with their stacks and last collectives. If ``fn`` calls ``pytest.skip`` the
    test is skipped.
    """
    __tracebackhide__ = True  # pytest: show the remote failure, not the harness internals
    if _worker.in_worker():
        raise RuntimeError("run_distributed cannot be nested inside a distributed worker")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"run_distributed(fn={getattr(fn, '__qualname__', fn)!r}): fn is defined in "
            "__main__, which worker processes cannot import; move it into a module."
        )
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise ValueError(
            f"run_distributed could not pickle fn={fn!r} with its arguments ({exc}); fn must "
            "be a module-level function and args/kwargs picklable."
        ) from exc
    with _LOCK:
        pool = get_pool(world_size)
        results, skips = pool.run(payload, timeout, backend, _assert_rewritten_modules(fn))
    skipped = [s for s in skips if s is not None]
    if skipped:
        import pytest

        pytest.skip(skipped[0])
    return results
