"""Environment for the integration workers (shared by ``conftest.py`` and the tests)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker_env(site: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a worker: the shim (``site``) first on ``PYTHONPATH``, then the
    repository; the pytest process's launcher / Accelerate variables removed; ``extra``.
    ``site=None``: the repository only (a worker run by ``.venv-peers``' real DeepSpeed)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(p) for p in (site, ROOT) if p is not None]),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        }
    )
    env.update(extra or {})
    return env


def free_port() -> int:
    """A TCP port nobody listens on now (for a worker's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
