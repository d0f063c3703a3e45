"""The compatibility distribution's ``deepspeed`` console command and
``deepspeed.launcher.runner``: DeepSpeed's launcher entry point, backed by shardspeed's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from integration_env import worker_env


def test_deepspeed_command_is_the_shardspeed_launcher(compat_site: Path, tmp_path: Path) -> None:
    command = compat_site / "bin" / "deepspeed"
    assert command.is_file()
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    done = subprocess.run(
        [sys.executable, str(command), "--num_gpus", "2", "--master_port", "29876"]
        + ["--dry_run", str(script), "--epochs", "1"],
        capture_output=True,
        text=True,
        env=worker_env(compat_site),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout + done.stderr
    assert "torch.distributed.run" in text and "--nproc_per_node 2" in text
    assert "--master_port 29876" in text and f"{script} --epochs 1" in text


def test_launcher_runner_module_path(compat_site: Path) -> None:
    code = (
        "import deepspeed.launcher.runner as r, shardspeed.launcher.runner as s\n"
        "assert r is s and callable(r.main)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=worker_env(compat_site)
    )
    assert done.returncode == 0, done.stderr
