"""Wiring for the integration tests: the real transformers / accelerate against shardspeed.

transformers and accelerate find DeepSpeed through ``importlib.metadata`` ("is a
distribution named ``deepspeed`` installed?") and then ``import deepspeed``. The
compatibility distribution (``compat/deepspeed``, ``make compat``) provides both; these
tests install it once per session into a scratch directory (``compat/install.py --target``,
the same mechanism as ``tests/unit/test_compat_distribution.py``) and run each worker script
in a subprocess whose ``PYTHONPATH`` starts with that directory. Nothing is installed into
the venv, so a fresh clone's ``make test`` needs no manual step, and ``import deepspeed``
never leaks into the pytest process (other tests check it is absent).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from integration_env import free_port, worker_env

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
INSTALL = ROOT / "compat" / "install.py"


def _need(*names: str) -> None:
    for name in names:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="session")
def launch() -> Callable[[int], list[str]]:
    """``launch(n)``: the ``shardspeed --nproc n`` command line, on a free port."""

    def command(nproc: int) -> list[str]:
        return [sys.executable, "-m", "shardspeed.launcher", "--nproc", str(nproc)] + [
            "--master_port",
            str(free_port()),
        ]

    return command


@pytest.fixture(scope="session")
def compat_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the ``deepspeed`` compatibility distribution (built from the tree)."""
    _need("transformers", "accelerate")
    site = tmp_path_factory.mktemp("compat_site")
    done = subprocess.run(
        [sys.executable, str(INSTALL), "--target", str(site)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return site


@pytest.fixture(scope="session")
def run_worker(compat_site: Path) -> Callable[..., dict[str, Any]]:
    """``run_worker(script, out_dir, *args, env=None, launcher=None)`` -> the worker's JSON.

    The worker writes its result to ``out_dir / "result.json"``; a non-zero exit fails the
    test with the worker's stderr tail.
    """

    def run(
        script: str,
        out_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        launcher: list[str] | None = None,
        timeout: int = 600,
    ) -> dict[str, Any]:
        out_dir.mkdir(parents=True, exist_ok=True)
        single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        single["MASTER_PORT"] = str(free_port())
        full_env = worker_env(compat_site, {} if launcher else single)
        full_env.update(env or {})
        cmd = [*(launcher or [sys.executable]), str(HERE / script), str(out_dir), *args]
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=out_dir
        )
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-6000:])
        return json.loads((out_dir / "result.json").read_text())

    return run
