"""The per-rank, per-engine directory of swap files under ``nvme_path``, and its checks.

The directory is ``<nvme_path>/shardspeed-swap-rank<R>-<pid>-<id>``: ranks, processes and
engines never share files. It is removed by ``close()`` (``engine.destroy()``) and, as a
fallback, when the object is garbage collected or the interpreter exits. Problems a user
can fix raise ``ValueError`` naming the ds_config key, the value and the fix: a missing
or unwritable ``nvme_path``, and not enough free space (checked up front; a full disk
during a later write raises the same message through :meth:`no_space_error`).
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from pathlib import Path

from shardspeed.config.base import explain


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


class SwapDir:
    """A fresh directory for one engine's swap files on one rank."""

    def __init__(self, nvme_path: str, key: str, rank: int, needed_bytes: int) -> None:
        self.key = key
        self.nvme_path = nvme_path
        base = Path(nvme_path)
        if not base.is_dir():
            raise ValueError(
                explain(
                    f"{key}.nvme_path does not exist or is not a directory",
                    nvme_path,
                    allowed="an existing, writable directory on a local (NVMe) drive",
                    fix=f"create it (mkdir -p {nvme_path}) or point {key}.nvme_path at one",
                )
            )
        if not os.access(base, os.W_OK | os.X_OK):
            raise self._unwritable(None)
        self.check_space(needed_bytes)
        name = f"shardspeed-swap-rank{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = base / name
        try:
            self.path.mkdir()
        except PermissionError as err:
            raise self._unwritable(err) from err
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def _unwritable(self, err: OSError | None) -> ValueError:
        detail = f" ({err.strerror})" if err is not None else ""
        return ValueError(
            explain(
                f"{self.key}.nvme_path is not writable by this process{detail}",
                self.nvme_path,
                allowed="a directory this user can create files in",
                fix=f"chmod/chown it, or point {self.key}.nvme_path at a writable directory",
            )
        )

    def file(self, name: str) -> Path:
        return self.path / name

    def check_space(self, needed_bytes: int) -> None:
        """Raise the no-space error if ``nvme_path`` has less than ``needed_bytes`` free."""
        free = shutil.disk_usage(self.nvme_path).free
        if free < needed_bytes:
            raise self.no_space_error(Path(self.nvme_path), needed_bytes, free)

    def no_space_error(self, path: Path, nbytes: int, free: int | None = None) -> ValueError:
        """The error for a disk too small for the swap files (up front, or ENOSPC later)."""
        if free is None:
            try:
                free = shutil.disk_usage(self.nvme_path).free
            except OSError:
                free = 0
        return ValueError(
            explain(
                f"not enough free space under {self.key}.nvme_path for the swap files: "
                f"{_gib(nbytes)} needed (writing {path}), {_gib(free)} free",
                self.nvme_path,
                fix=f"free space on that drive, point {self.key}.nvme_path at a larger one, "
                f'or use "device": "cpu"',
            )
        )

    def close(self) -> None:
        """Delete the directory and every swap file in it."""
        self._cleanup()
