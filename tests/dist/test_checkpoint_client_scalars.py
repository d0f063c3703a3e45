"""0-dim tensors in ``client_state`` survive a save and load, in both layouts.

PyTorch Lightning's ``ModelCheckpoint`` always puts one there (``kth_value = tensor(inf)``);
reading it back used to fail with "slice() cannot be applied to a 0-dim tensor".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardspeed.testing import run_distributed


def _save_and_load(save_dir: str, layout: str) -> dict:
    import shardspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "checkpoint": {"layout": layout},
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    client = {"kth_value": torch.tensor(float("inf")), "best": torch.tensor(0.25), "epoch": 3}
    engine.save_checkpoint(save_dir, tag="checkpoint", client_state=client)
    _, loaded = engine.load_checkpoint(save_dir, tag="checkpoint")
    engine.destroy()
    return loaded


@pytest.mark.parametrize("layout", ["native", "deepspeed"])
def test_scalar_tensors_in_client_state_round_trip(tmp_path: Path, layout: str) -> None:
    loaded = run_distributed(_save_and_load, 2, str(tmp_path), layout)[0]
    assert loaded["epoch"] == 3
    assert loaded["kth_value"].shape == () and torch.isinf(loaded["kth_value"])
    torch.testing.assert_close(loaded["best"], torch.tensor(0.25))
    if layout == "deepspeed":  # what Lightning's converter reads with torch.load
        state = torch.load(
            tmp_path / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False
        )
        assert torch.isinf(state["kth_value"])
