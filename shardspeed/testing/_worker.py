"""The loop a warm worker process runs for :mod:`shardspeed.testing.pool`.

One process per rank. It waits for a task on its task pipe, joins a fresh process group
(a prefix of the parent's TCP store, so every call has its own keys), runs the function,
tears the group down, resets registered module state and answers with the pickled result
or the formatted traceback. A daemon thread answers "dump" requests on a second pipe with
the main thread's Python stack and the rank's recent collectives, which is how the parent
explains a timeout. When the parent dies, both pipes hit EOF and the worker exits.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

_IN_WORKER = False
_RANK: int | None = None


def in_worker() -> bool:
    """True inside a harness worker process (while or between running tasks)."""
    return _IN_WORKER


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (best effort)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass


def _main_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "<main thread stack unavailable>"
    frames = traceback.extract_stack(frame)
    harness = [i for i, f in enumerate(frames) if f.filename == __file__]
    if harness and harness[-1] + 1 < len(frames):
        frames = frames[harness[-1] + 1 :]  # start at the test's own function
    return "".join(traceback.format_list(frames))


def _recent_ops() -> list[dict[str, Any]]:
    # Never import here: the main thread may hold the import lock while hung.
    comm = sys.modules.get("shardspeed.comm")
    if comm is None or not hasattr(comm, "recent_ops"):
        return []
    try:
        return list(comm.recent_ops())
    except Exception:
        return []


def _control_loop(ctrl: Any) -> None:
    while True:
        try:
            request = ctrl.recv()
        except (EOFError, OSError):
            os._exit(3)  # parent is gone: leave even if the main thread is stuck
        if request == "dump":
            try:
                ctrl.send({"stack": _main_stack(), "recent_ops": _recent_ops()})
            except (BrokenPipeError, OSError):
                os._exit(3)


def _format_exception(exc: BaseException) -> str:
    """The traceback of ``exc`` without this module's own frames at its top."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _redirect_output(path: str) -> None:
    """Point fds 1 and 2 at a fresh per-call log file the parent reads afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _import_with_assert_rewriting(name: str, path: str) -> None:
    """Import a pytest test module the way pytest does, so ``assert a == b`` shows values."""
    import ast
    import importlib.util

    from _pytest.assertion.rewrite import rewrite_asserts

    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path, None)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise


def _setup_process_group(rank: int, spec: dict[str, Any], base_store: Any) -> None:
    import torch
    import torch.distributed as dist

    backend = spec["backend"]
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.PrefixStore(f"call{spec['call_id']}/", base_store)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=spec["world_size"],
        timeout=timedelta(seconds=spec["pg_timeout_s"]),
    )


def _teardown_process_group(barrier: bool) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def _run_task(rank: int, spec: dict[str, Any], base_store: Any, tasks: Any) -> tuple[str, Any]:
    import torch

    from shardspeed.utils.reset_hooks import run_reset_hooks

    sys.path[:] = spec["sys_path"]
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    # torch process state a test may have changed (seeding is left to the tests)
    torch.set_num_threads(int(os.environ.get("SHARDSPEED_TEST_NUM_THREADS", "1")))
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    for name, path in spec["rewrite_modules"]:
        if name not in sys.modules:
            _import_with_assert_rewriting(name, path)
    run_reset_hooks()
    _setup_process_group(rank, spec, base_store)
    ok = False
    try:
        fn, args, kwargs = pickle.loads(spec["payload"])
        result = fn(*args, **kwargs)
        ok = True
        tasks.send(("returned", rank, None, 0.0))  # lets a timeout tell "hung in fn" apart
    finally:
        # On failure skip the barrier: peers may never arrive; the parent kills the pool.
        if ok:
            _teardown_process_group(barrier=True)
    run_reset_hooks()
    try:
        return "ok", pickle.dumps(result)
    except Exception as exc:
        raise TypeError(
            f"rank {rank} returned a value of type {type(result).__name__} that cannot be "
            f"pickled back to the parent ({exc}); return plain data (tensors, numbers, lists)."
        ) from exc


def worker_main(rank: int, tasks: Any, ctrl: Any) -> None:
    """Entry point of one warm worker: serve tasks until told to exit or the parent dies."""
    global _IN_WORKER, _RANK
    _IN_WORKER, _RANK = True, rank
    _die_with_parent()
    threading.Thread(target=_control_loop, args=(ctrl,), daemon=True).start()

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    base_store = None
    store_addr: tuple[str, int] | None = None
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            os._exit(0)
        if message[0] == "exit":
            os._exit(0)
        spec = message[1]
        _redirect_output(spec["log_path"])
        start = time.perf_counter()
        try:
            addr = (spec["store_host"], spec["store_port"])
            if base_store is None or store_addr != addr:
                base_store = dist.TCPStore(
                    addr[0], addr[1], is_master=False, timeout=timedelta(seconds=60)
                )
                store_addr = addr
            status, body = _run_task(rank, spec, base_store, tasks)
        except BaseException as exc:
            if type(exc).__name__ == "Skipped":  # pytest.skip() called on this rank
                status, body = "skip", str(exc)
            else:
                status, body = "error", _format_exception(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            tasks.send((status, rank, body, time.perf_counter() - start))
        except (BrokenPipeError, OSError):
            os._exit(0)
