"""Oracle: a ShardSpeed checkpoint in DeepSpeed's layout, loaded by real DeepSpeed 0.19.8.

ShardSpeed (2 gloo ranks) trains the parity GPT 3 steps at ZeRO 1, 2 or 3 (fp32, and bf16
at ZeRO 2), saves with ``"checkpoint": {"layout": "deepspeed"}`` and trains 3 more. Real
DeepSpeed (2 ranks under ``torch.distributed.run``, gloo, CPU) builds the same model from
another seed, ``load_checkpoint``s the folder and trains the same 3 steps: its losses equal
ShardSpeed's continued ones (fp32: 1e-5; bf16: 1e-2) and its counters and learning rate are
the checkpoint's.

The DeepSpeed losses are recorded in ``tests/goldens/deepspeed_layout/losses.json``;
``test_checkpoint_deepspeed_layout.py`` checks ShardSpeed against them without DeepSpeed.
The test is collected only where ``.venv-peers`` imports DeepSpeed (never a skip on a fresh
clone); it launches DeepSpeed with that venv's interpreter. Re-record with
``SHARDSPEED_RECORD_GOLDENS=1 .venv/bin/python -m pytest
tests/dist/test_checkpoint_deepspeed_layout_oracle.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepspeed_layout_common import (
    MORE_STEPS,
    SAVED_STEPS,
    config,
    shardspeed_save_and_continue,
    spec,
    train,
)
from goldens import deepspeed_oracle
from parity_common import make_model

from shardspeed.testing import run_distributed

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "deepspeed_layout" / "losses.json"
CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")]


def _deepspeed_rank(load_dir: str, stage: int, precision: str, result_dir: str) -> None:
    """One DeepSpeed rank (under torch.distributed.run): load ShardSpeed's folder, train on."""
    import deepspeed

    model = make_model(spec(precision).__class__(world=2, precision=precision, seed=999))
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(stage, precision, torch_adam=True),
    )
    path, client = engine.load_checkpoint(load_dir)
    assert path is not None, "DeepSpeed found no checkpoint"
    rank = torch.distributed.get_rank()
    loaded = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "epoch": client.get("epoch"),
    }
    losses = train(engine, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS), rank, precision)
    torch.save({"losses": losses, "loaded": loaded}, Path(result_dir) / f"rank{rank}.pt")
    engine.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_deepspeed(load_dir: Path, stage: int, precision: str, result_dir: Path) -> list[dict]:
    result_dir.mkdir()
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])])}
    python = deepspeed_oracle.live_python()
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [__file__, str(load_dir), str(stage), precision, str(result_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(result_dir / f"rank{r}.pt") for r in range(2)]


# defined only where the peers venv imports DeepSpeed: a fresh clone collects nothing here
if deepspeed_oracle.peers_python() is not None:

    @pytest.mark.parametrize(("stage", "precision"), CASES)
    def test_deepspeed_loads_shardspeed_checkpoint(
        tmp_path: Path, stage: int, precision: str
    ) -> None:
        ours = run_distributed(
            shardspeed_save_and_continue, 2, str(tmp_path / "ckpt"), stage, precision, timeout=300
        )
        ds = run_deepspeed(tmp_path / "ckpt", stage, precision, tmp_path / "ds")
        tol = 1e-5 if precision == "fp32" else 1e-2
        for rank in range(2):
            assert ds[rank]["loaded"] == {"global_steps": 3, "global_samples": 12, "epoch": 3}
            torch.testing.assert_close(
                torch.tensor(ds[rank]["losses"]),
                torch.tensor(ours[rank]["more"]),
                rtol=tol,
                atol=tol,
            )
        if os.environ.get("SHARDSPEED_RECORD_GOLDENS") == "1":
            golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
            golden[f"zero{stage}_{precision}"] = [ds[r]["losses"] for r in range(2)]
            GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":  # a DeepSpeed rank, started by run_deepspeed
    _deepspeed_rank(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
