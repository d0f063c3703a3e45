"""``@distributed_test``: write a test body once, run it on every rank."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from shardspeed.testing import _worker
from shardspeed.testing.pool import run_distributed

F = TypeVar("F", bound=Callable[..., Any])


def distributed_test(world_size: int = 2, timeout: float = 120.0, backend: str = "gloo"):
    """Decorate a module-level test so that its body runs on ``world_size`` ranks.

    In the pytest process the decorated test calls :func:`run_distributed` with itself and
    its (fixture/parametrize) arguments, which must be picklable (``tmp_path`` is); inside a
    worker it simply runs the body. The test is marked ``world_size(n)``. Methods of test
    classes are not supported (the worker could not import them by name).

    Example::

        @distributed_test(world_size=2)
        def test_all_reduce():
            t = torch.ones(3)
            comm.all_reduce(t)
            assert t.tolist() == [2.0, 2.0, 2.0]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"distributed_test(world_size=...) must be an int >= 1, got {world_size!r}"
        )

    def decorate(body: F) -> F:
        @functools.wraps(body)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if _worker.in_worker():
                return body(*args, **kwargs)
            run_distributed(wrapper, world_size, *args, timeout=timeout, backend=backend, **kwargs)
            return None

        try:
            import pytest

            wrapper = pytest.mark.world_size(world_size)(wrapper)
        except ImportError:  # pragma: no cover - pytest is a test-only dependency
            pass
        return wrapper  # type: ignore[return-value]

    return decorate
