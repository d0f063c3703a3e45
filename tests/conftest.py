"""Project-wide pytest wiring: distributed worker pools, GPU skips."""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        return False


def pytest_configure(config: pytest.Config) -> None:
    """Without a GPU, Triton kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET`` is
    read when ``triton`` is first imported, which may happen anywhere in the session (e.g.
    through ``torch.compile``), so it is set before any test runs."""
    import os

    if not _cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests when no CUDA device is present."""
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the JIT CPU kernels (FastGen's attention, fused elementwise and GEMV kernels, the
    native CPU Adam) before any test runs, side by side.

    A first build takes about 20 s each on a 2-core machine; it is cached on disk, so doing it
    here keeps it out of whichever test would use a kernel first, e.g. a server subprocess that
    must report its address within a deadline. The builds are separate compiler processes, so
    running them from threads overlaps them (each has its own build directory and lock). A
    failed build is logged and the callers fall back to torch ops, as in use.
    """
    from concurrent.futures import ThreadPoolExecutor

    from shardspeed.inference.fastgen import cpu_attention, cpu_fused
    from shardspeed.ops import cpu_adam, cpu_gemm, cpu_gemv

    builds = [
        cpu_attention.kernel_available,
        cpu_fused.kernel_available,
        cpu_gemv.kernel_dtypes,
        cpu_gemm.available,
        cpu_adam.select_backend,
    ]
    with ThreadPoolExecutor(len(builds)) as pool:
        for future in [pool.submit(build) for build in builds]:
            future.result()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_distributed_pools():
    """Stop the warm multi-process worker pools when the session ends.

    Pools are also stopped by an atexit hook, and workers exit on their own when this
    process dies (their pipes close), so an interrupted run leaks no processes.
    """
    yield
    from shardspeed.testing import shutdown_pools

    shutdown_pools()


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request: pytest.FixtureRequest):
    """A test that joins a process group in the pytest process must leave it: one left behind
    turns every later test that expects a single, uninitialised process into a failure far
    from its cause (run such code through ``shardspeed.testing.run_distributed``)."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            f"{request.node.nodeid} left torch.distributed initialised in the pytest process"
        )
