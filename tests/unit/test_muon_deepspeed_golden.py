"""ShardSpeed's Muon against DeepSpeed 0.19.8's ``SingleDeviceMuonWithAuxAdam`` (fp32).

Three matrices (tall, wide, square) with Muon and one vector with the auxiliary AdamW,
weight decay 0.1, 5 steps of seeded random gradients, both ``ns_method`` values, as
``benchmarks/muon_deepspeed_oracle.py``. DeepSpeed picks its Newton-Schulz dtype from the
accelerator (bf16 for ``standard`` on a CPU); both run fp32 here, so the comparison is of
the algorithm. DeepSpeed's parameters after the 5 steps are recorded in
``tests/goldens/muon/`` (``source="golden"``, run everywhere) or computed live by the peers
venv (``source="deepspeed"``, ``tests/goldens/muon/deepspeed_side.py``; see
``tests/goldens/README.md``). Tolerance rtol 1e-5, atol 1e-6, on parameters of magnitude
0.1-0.4 (the benchmark measured about 3e-7 of the largest).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from goldens import deepspeed_oracle as golden

from shardspeed.ops.muon import Muon

SHAPES = [(24, 8), (8, 24), (16, 16), (24,)]  # the first three with Muon
SETTINGS = {
    "methods": ["standard", "gram"],
    "steps": 5,
    "muon": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1},
    "adam": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-10, "weight_decay": 0.1},
}
SIDE = golden.GOLDENS / "muon" / "deepspeed_side.py"
# the live variant starts the peers venv and imports DeepSpeed: slow
SOURCES = [pytest.param(s, marks=pytest.mark.slow) if s != "golden" else s
           for s in golden.ORACLE_SOURCES]  # fmt: skip


def _inputs() -> dict[str, torch.Tensor]:
    """Initial parameters ``p{i}`` and every step's gradients ``g{step}_{i}``, seeded."""
    g = torch.Generator().manual_seed(0)
    out = {f"p{i}": torch.randn(*s, generator=g) * 0.1 for i, s in enumerate(SHAPES)}
    for step in range(SETTINGS["steps"]):
        for i, s in enumerate(SHAPES):
            out[f"g{step}_{i}"] = torch.randn(*s, generator=g)
    return out


def _ours(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    muon, adam = SETTINGS["muon"], SETTINGS["adam"]
    out = {}
    for method in SETTINGS["methods"]:
        params = [inputs[f"p{i}"].clone() for i in range(len(SHAPES))]
        groups = [
            {"params": params[:3], "use_muon": True},
            {"params": params[3:], "use_muon": False},
        ]
        opt = Muon(groups, muon_lr=muon["lr"], adam_lr=adam["lr"], momentum=muon["momentum"],
                   weight_decay=muon["weight_decay"], betas=tuple(adam["betas"]), eps=adam["eps"],
                   ns_method=method, ns_dtype="fp32")  # fmt: skip
        for step in range(SETTINGS["steps"]):
            for i, p in enumerate(params):
                p.grad = inputs[f"g{step}_{i}"].clone()
            opt.step()
        out.update({f"{method}_{i}": p.detach().clone() for i, p in enumerate(params)})
    return out


def _live(inputs: dict[str, torch.Tensor], tmp: Path) -> dict[str, Any]:
    torch.save(inputs, tmp / "inputs.pt")
    cmd = [golden.live_python(), str(SIDE), str(tmp / "inputs.pt"), json.dumps(SETTINGS),
           str(tmp / "out.pt")]  # fmt: skip
    env = {**golden.live_env(), "DS_ACCELERATOR": "cpu"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=600)
    params = torch.load(tmp / "out.pt", weights_only=True)
    return {"params": params, "inputs": golden.fingerprint(inputs)}


@pytest.mark.parametrize("source", SOURCES)
def test_muon_matches_deepspeed(source: str, tmp_path: Path) -> None:
    inputs = _inputs()
    theirs = golden.deepspeed_side(
        source, "muon", "single_device_0198.pt", lambda: _live(inputs, tmp_path)
    )
    golden.check_inputs(theirs, golden.fingerprint(inputs), "Muon vs DeepSpeed")
    ours = _ours(inputs)
    assert set(ours) == set(theirs["params"])
    for name, value in theirs["params"].items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)
