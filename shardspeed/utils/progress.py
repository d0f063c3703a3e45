"""Rank-aware progress output.

``progress(...)`` wraps ``tqdm``: a live bar on global rank 0 when stderr is a terminal.
In a non-terminal log (a batch job, ``tee``) a bar would write thousands of carriage
returns, so instead one log line is written each time another ~10% completes (or every
60 s when the total is unknown). Other ranks stay silent. ``set_postfix`` and ``update``
work the same either way.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

_LOG_EVERY_FRACTION = 0.1
_LOG_EVERY_S_UNKNOWN_TOTAL = 60.0


def _global_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0"))


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Iterable progress tracker; either a tqdm bar, periodic log lines, or silent."""

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        total: int | None = None,
        desc: str = "",
        disable: bool | None = None,
        unit: str = "it",
    ) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self._start = time.monotonic()
        self._last_log_time = self._start
        self._next_log_fraction = _LOG_EVERY_FRACTION
        self._bar: Any = None
        self.mode = self._choose_mode(disable)
        if self.mode == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc or None, unit=unit, file=sys.stderr)

    @staticmethod
    def _choose_mode(disable: bool | None) -> str:
        """'bar', 'log' or 'off'. ``disable=False`` forces a bar on rank 0 even off a TTY."""
        if disable is True or _global_rank() != 0:
            return "off"
        if disable is False or _stderr_is_tty():
            return "bar"
        return "log"

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise ValueError("progress(): iterate only when constructed with an iterable")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("progress(): total is unknown")
        return self.total

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units."""
        self.n += n
        if self.mode == "bar":
            self._bar.update(n)
        elif self.mode == "log":
            self._maybe_log()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Show ``key=value`` pairs after the bar (or at the end of each log line)."""
        self.postfix = {**(ordered_dict or {}), **kwargs}
        if self.mode == "bar":
            self._bar.set_postfix(self.postfix)

    def set_description(self, desc: str) -> None:
        self.desc = desc
        if self.mode == "bar":
            self._bar.set_description(desc)

    def _line(self) -> str:
        elapsed = time.monotonic() - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            head += f"{100 * self.n / self.total:3.0f}% ({self.n}/{self.total} {self.unit})"
        else:
            head += f"{self.n} {self.unit}"
        text = f"{head} [{elapsed:.1f}s, {rate:.2f} {self.unit}/s]"
        if self.postfix:
            text += " " + ", ".join(f"{k}={_fmt(v)}" for k, v in self.postfix.items())
        return text

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.total:
            fraction = self.n / self.total
            if fraction + 1e-9 < self._next_log_fraction:
                return
            while self._next_log_fraction <= fraction + 1e-9:
                self._next_log_fraction += _LOG_EVERY_FRACTION
        elif now - self._last_log_time < _LOG_EVERY_S_UNKNOWN_TOTAL:
            return
        self._last_log_time = now
        logger.info(self._line())

    def close(self) -> None:
        """Finish the bar (no-op when logging or silent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def progress(
    iterable: Iterable[Any] | None = None,
    total: int | None = None,
    desc: str = "",
    disable: bool | None = None,
    unit: str = "it",
) -> Progress:
    """A progress tracker for ``iterable`` (or manual ``update()`` calls with ``total``).

    ``disable=None``: bar on rank 0 when stderr is a TTY, ~10% log lines on rank 0 otherwise,
    silent on other ranks. ``disable=True``: silent. ``disable=False``: bar on rank 0 always.
    """
    return Progress(iterable, total=total, desc=desc, disable=disable, unit=unit)
