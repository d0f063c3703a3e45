"""Turning backend failures of collectives into this rank's report.

:func:`guarded` wraps every collective of :mod:`shardspeed.comm.collectives`; the async
handles it returns are :class:`GuardedWork`, whose ``wait()`` reports the same way. The
failing collective is the one this thread noted last (:func:`~shardspeed.comm.logger.last_entry`),
or, for a handle, the one it was issued as.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from shardspeed.comm.errors import collective_failure
from shardspeed.comm.logger import last_entry, recent_entries


class GuardedWork:
    """A ``Work`` handle whose ``wait()`` raises this rank's report on a timeout/failure."""

    __slots__ = ("_entry", "_work")

    def __init__(self, work: Any, entry: tuple[Any, ...] | None = None) -> None:
        self._work = work
        self._entry = entry

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self._work.wait(*args, **kwargs)
        except RuntimeError as exc:
            error = collective_failure(self._entry, exc, recent_entries(), waited=True)
            if error is None:
                raise
            raise error from exc
        self._completed()
        return result

    def _completed(self) -> None:
        """Hook run after a successful ``wait()``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _guard(work: Any, entry: tuple[Any, ...] | None) -> GuardedWork:
    if isinstance(work, GuardedWork):  # a TimedWork from the logged path
        work._entry = entry  # noqa: SLF001
        return work
    return GuardedWork(work, entry)


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn backend timeouts/failures of ``fn`` into reports; guard the handles it returns."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except RuntimeError as exc:
            error = collective_failure(last_entry(), exc, recent_entries(), waited=False)
            if error is None:
                raise
            raise error from exc
        if result is None or isinstance(result, int):  # a sync op (recv: the sender)
            return result
        entry = last_entry()
        if isinstance(result, list):
            return [_guard(work, entry) for work in result]
        return _guard(result, entry)

    return call
