"""Rank-aware logging.

Library code logs through :func:`get_logger`. Messages go to rank 0 by default
(``log_dist``); ``info_once``/``warning_once`` keep repeated conditions from
flooding the log.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

_ROOT_NAME = "shardspeed"
_configured = False


def _rank() -> int:
    """Global rank from torch.distributed if initialised, else from the launcher's env."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - torch missing or broken
        pass
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return True


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger(_ROOT_NAME)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(
            logging.Formatter("[%(asctime)s] [%(levelname)s] [rank%(rank)s] %(name)s: %(message)s")
        )
        root.addHandler(handler)
    level = os.environ.get("SHARDSPEED_LOG_LEVEL", "INFO").upper()
    root.setLevel(getattr(logging, level, logging.INFO))
    root.propagate = False
    _configured = True


def get_logger(name: str = _ROOT_NAME) -> logging.Logger:
    """Return a logger under the ``shardspeed`` hierarchy."""
    _configure_root()
    if not name.startswith(_ROOT_NAME):
        name = f"{_ROOT_NAME}.{name}"
    return logging.getLogger(name)


logger = get_logger()


def log_dist(
    message: str, ranks: list[int] | None = None, level: int = logging.INFO, name: str = _ROOT_NAME
) -> None:
    """Log ``message`` only on the given global ranks (default: rank 0; ``[-1]`` = all)."""
    ranks = [0] if ranks is None else ranks
    if -1 in ranks or _rank() in ranks:
        get_logger(name).log(level, message)


@functools.cache
def _once(level: int, name: str, message: str) -> None:
    get_logger(name).log(level, message)


def info_once(message: str, name: str = _ROOT_NAME) -> None:
    """Log an info message once per process."""
    _once(logging.INFO, name, message)


def warning_once(message: str, name: str = _ROOT_NAME) -> None:
    """Log a warning once per process."""
    _once(logging.WARNING, name, message)
