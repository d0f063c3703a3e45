"""Accelerate's ``DeepSpeedPlugin`` (ZeRO 2 and 3) on shardspeed, against plain PyTorch.

``accelerate_worker.py`` runs the documented loop (``prepare``, ``accumulate``, ``backward``,
``clip_grad_norm_``, ``save_state`` / ``load_state``, ``get_state_dict``) on a tiny random
Llama for 4 optimizer steps of 2 micro-batches with clipping at 0.5 and a ``LambdaLR``, and
the same steps as a plain PyTorch loop. Tolerance: fp32 parity (rtol 1e-5, atol 1e-6) for
losses, the gradient norms ``clip_grad_norm_`` returns and the final full weights. Stage 3
runs by default; stage 2 is marked slow (``make test-slow``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and got
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= TOL["atol"] + TOL["rtol"] * abs(b), (index, a, b)


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_accelerate_deepspeed_plugin_matches_plain_pytorch(
    stage: int, run_worker: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    result = run_worker("accelerate_worker.py", tmp_path, str(stage))
    assert result["engine"] == "ShardSpeedEngine"
    assert result["distributed_type"] == "DistributedType.DEEPSPEED"
    assert len(result["losses"]) == 8 and len(result["norms"]) == 4
    _close(result["losses"], result["ref_losses"])
    _close(result["norms"], result["ref_norms"])  # clip_grad_norm_ = the pre-clip global norm
    assert result["state_keys_match"]
    assert result["weight_max_abs_err"] <= 1e-5
    # load_state rewinds model, optimizer and scheduler: the last two steps replay exactly
    _close(result["reloaded_losses"], result["losses"][4:])
    _close(result["reloaded_norms"], result["norms"][2:])
    assert "latest" in result["state_files"] and "scheduler.bin" in result["state_files"]
