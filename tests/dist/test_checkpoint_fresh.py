"""Exact resume in fresh processes, and a save during which one rank is SIGKILLed.

Two ``torch.distributed.run`` launches of ``ckpt_fresh_worker.py`` on 2 gloo ranks:

1. ``train``: per ZeRO stage 0-3 x fp32/bf16 (dropout, shuffled dataloader, WarmupLR):
   10 straight steps; a new engine trains 4 steps and saves ``global_step4``. Then one
   more step and a save of ``global_step5`` during which rank 1 SIGKILLs itself halfway
   through its safetensors file. Rank 0 must not hang: its commit fails as soon as the
   peer is gone (at worst after the 20 s process-group timeout) or torchrun tears it down.
2. ``resume``: new processes load every checkpoint (the killed one resolves to
   ``global_step4``) into engines built from another seed and train 6 steps.

Losses and parameters of 4 + 6 steps equal the 10 straight steps bitwise, and the killed
save left ``latest`` and ``global_step4`` intact and published nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

WORKER = Path(__file__).with_name("ckpt_fresh_worker.py")
KILLED = "s3_bf16"  # the last configuration of the worker


def _launch(phase: str, out: Path) -> subprocess.CompletedProcess[str]:
    # the survivor of the killed save waits 1 s (not 5) for fault reports before it exits
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDSPEED_ACCELERATOR": "cpu",
           "SHARDSPEED_BLAME_GRACE": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*argv, str(WORKER), phase, str(out)],
        cwd=WORKER.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_exact_resume_in_fresh_processes_after_a_killed_save(tmp_path: Path) -> None:
    started = time.monotonic()
    train = _launch("train", tmp_path)
    train_s = time.monotonic() - started
    log = train.stdout + train.stderr
    assert train.returncode != 0, log
    assert "Signals.SIGKILL" in log or "SIGKILL" in log, log[-4000:]
    assert train_s < 120, f"the surviving rank hung for {train_s:.0f} s"

    killed = tmp_path / KILLED
    assert (killed / "latest").read_text() == "global_step4"
    assert not (killed / "global_step5").exists()
    partial = [p for p in killed.iterdir() if p.name.startswith("global_step5.tmp-")]
    assert len(partial) == 1 and not (partial[0] / "manifest.json").exists()

    resume = _launch("resume", tmp_path)
    assert resume.returncode == 0, (resume.stdout + resume.stderr)[-6000:]
    for rank in range(2):
        first = json.loads((tmp_path / f"train_rank{rank}.json").read_text())
        rest = json.loads((tmp_path / f"resume_rank{rank}.json").read_text())
        straight_params = load_file(str(tmp_path / f"train_rank{rank}.st"))
        resumed_params = load_file(str(tmp_path / f"resume_rank{rank}.st"))
        assert set(straight_params) == set(resumed_params)
        names = sorted({k.split("/")[0] for k in rest})
        assert len(names) == 8, names
        for name in names:
            label = f"rank {rank} {name}"
            straight = first[f"{name}/straight"]
            assert first[f"{name}/first"] + rest[f"{name}/rest"] == straight, label
        for key, value in straight_params.items():
            assert value.equal(resumed_params[key]), f"rank {rank}: {key} differs"
