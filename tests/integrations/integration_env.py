"""Environment for the integration workers (shared by ``conftest.py`` and the tests)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker_env(site: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a worker: the shim (``site``) first on ``PYTHONPATH``, then the
    repository; the pytest process's launcher / Accelerate variables removed; ``extra``."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ACCELERATE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        }
    )
    env.update(extra or {})
    return env
