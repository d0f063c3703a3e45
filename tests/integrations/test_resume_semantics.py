"""What ``load_checkpoint`` restores, against DeepSpeed 0.19.8's behaviour.

DeepSpeed's ``engine.load_checkpoint`` restores model, optimizer, scheduler and counters but
no RNG state and no dataloader position (its ``runtime/engine.py`` never sets an RNG state;
only curriculum-learning samplers keep a position). ShardSpeed does the same by default;
``shardspeed.checkpoint.load_checkpoint(..., restore_rng=True)`` and the dataloader's
``exact_resume`` are the explicit options for an exact resume.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardspeed.testing import run_distributed


def _rng_after_load(tmp: str) -> dict[str, bool]:
    import shardspeed
    from shardspeed.checkpoint import load_checkpoint

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(8.0).view(8, 1))
    engine, _, loader, _ = shardspeed.initialize(
        model=torch.nn.Linear(1, 1),
        training_data=data,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 1},
        },
    )
    batches = iter(loader)
    (x,) = next(batches)
    engine.backward(engine(x).sum())
    engine.step()
    saved_rng = torch.get_rng_state()
    engine.save_checkpoint(os.path.join(tmp, "ckpt"))  # saved at loader position 1
    next(batches)  # position 2
    torch.manual_seed(123)
    after_seed = torch.get_rng_state()
    engine.load_checkpoint(os.path.join(tmp, "ckpt"))
    default_keeps = torch.equal(torch.get_rng_state(), after_seed)
    position_kept = loader.position == 2  # not rewound to the saved position
    load_checkpoint(engine, os.path.join(tmp, "ckpt"), restore_rng=True)
    opt_in_restores = torch.equal(torch.get_rng_state(), saved_rng)
    engine.destroy()
    return {"default": default_keeps, "position": position_kept, "opt_in": opt_in_restores}


def test_load_checkpoint_restores_rng_only_when_asked(tmp_path: Path) -> None:
    (result,) = run_distributed(_rng_after_load, 1, str(tmp_path), timeout=300)
    assert result == {"default": True, "position": True, "opt_in": True}
