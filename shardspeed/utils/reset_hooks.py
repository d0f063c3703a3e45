"""Registry of callables that reset module-level state between runs in one process.

Any module that keeps process-wide state (caches, counters, loggers, default groups)
appends a reset function here::

    from shardspeed.utils.reset_hooks import register_reset_hook

    register_reset_hook(_clear_my_cache)

The warm worker processes of :func:`shardspeed.testing.run_distributed` are reused across
tests and call every hook before and after each call, in registration order. This module
imports only the standard library, so any library module may import it.
"""

from __future__ import annotations

from collections.abc import Callable

reset_hooks: list[Callable[[], None]] = []


def register_reset_hook(hook: Callable[[], None]) -> Callable[[], None]:
    """Add ``hook`` to :data:`reset_hooks` once (usable as a decorator); returns ``hook``."""
    if hook not in reset_hooks:
        reset_hooks.append(hook)
    return hook


def run_reset_hooks() -> None:
    """Call every registered hook; the first failure is raised after all hooks ran."""
    first_error: BaseException | None = None
    for hook in list(reset_hooks):
        try:
            hook()
        except Exception as exc:  # keep resetting the others
            if first_error is None:
                first_error = exc
    if first_error is not None:
        raise first_error
