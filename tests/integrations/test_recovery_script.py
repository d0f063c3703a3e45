"""``zero_to_fp32.py`` next to each ZeRO (or bf16) checkpoint, as DeepSpeed writes it.

Two ranks save a stage-2 checkpoint; rank 0 must have copied the executable script into
the save directory (a stage-0 fp32 save must not), and running the copied script as
DeepSpeed's users do (``python zero_to_fp32.py CKPT_DIR OUT_DIR``) must write the engine's
full fp32 weights exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardspeed.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _save(tmp: str) -> dict[str, torch.Tensor]:
    import shardspeed

    out: dict[str, torch.Tensor] = {}
    for stage in (0, 2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        engine, *_ = shardspeed.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                "zero_optimization": {"stage": stage},
            },
        )
        loss = engine(torch.randn(2, 6)).square().mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(os.path.join(tmp, f"s{stage}"))
        out = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        engine.destroy()
    return out


@pytest.mark.slow  # ~25 s: two engines on 2 ranks plus a subprocess
def test_zero_checkpoint_carries_a_working_zero_to_fp32_script(tmp_path: Path) -> None:
    weights = run_distributed(_save, 2, str(tmp_path), timeout=300)[0]
    assert not (tmp_path / "s0" / "zero_to_fp32.py").exists()  # no ZeRO, no bf16
    script = tmp_path / "s2" / "zero_to_fp32.py"
    assert script.is_file() and os.access(script, os.X_OK)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "s2"), str(tmp_path / "fp32")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    files = list((tmp_path / "fp32").iterdir())
    assert files, "the script wrote nothing"
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded.update(load_file(str(f)))
        elif f.suffix == ".bin":
            loaded.update(torch.load(f, weights_only=True))
    assert loaded.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(loaded[name].float(), tensor.float()), name
