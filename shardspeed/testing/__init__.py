"""Test helpers: the multi-process harness and numeric parity checks.

* :func:`run_distributed` / :func:`distributed_test`: run a function on N ranks (gloo on
  CPU by default) from warm, reused worker pools.
* :data:`reset_hooks` / :func:`register_reset_hook`: module-state resets run between calls.
* :mod:`shardspeed.testing.parity`: :func:`assert_close_rel`.
"""

from __future__ import annotations

from shardspeed.testing.decorators import distributed_test
from shardspeed.testing.parity import assert_close_rel
from shardspeed.testing.pool import (
    DistributedTestError,
    DistributedTestTimeout,
    run_distributed,
    shutdown_pools,
)
from shardspeed.utils.reset_hooks import register_reset_hook, reset_hooks, run_reset_hooks

__all__ = [
    "DistributedTestError",
    "DistributedTestTimeout",
    "assert_close_rel",
    "distributed_test",
    "register_reset_hook",
    "reset_hooks",
    "run_distributed",
    "run_reset_hooks",
    "shutdown_pools",
]
