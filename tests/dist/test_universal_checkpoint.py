"""DeepSpeed universal checkpoints in ShardSpeed (no DeepSpeed needed).

* ``tests/goldens/deepspeed_layout/universal``: real DeepSpeed 0.19.8 (2 ranks, ZeRO 2)
  trained the tiny MLP 3 steps and converted its tag with its own ``ds_to_universal``
  (``universal_golden_worker.py``). ShardSpeed loads it with ``"checkpoint":
  {"load_universal": true}`` at world 1 (ZeRO 3, GAS 2: the same global batch) and world 2
  (ZeRO 1) and continues with DeepSpeed's own continued losses (1e-5).
* ShardSpeed's ``ds_to_universal`` on a ShardSpeed checkpoint saved in DeepSpeed's layout
  (2 ranks, ZeRO 2 and 3) loads at world 1 and continues like the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from deepspeed_layout_common import SCHEDULER, tiny_model, tiny_train

from shardspeed.testing import run_distributed

GOLDENS = Path(__file__).resolve().parents[1] / "goldens" / "deepspeed_layout"


def _config(stage: int, gas: int, **checkpoint: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": SCHEDULER,
        "checkpoint": dict(checkpoint),
    }


def _engine(cfg: dict):
    import shardspeed

    model = tiny_model()
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _load_universal_and_continue(load_dir: str, stage: int, gas: int) -> list[float]:
    torch.manual_seed(123)
    engine = _engine(_config(stage, gas, load_universal=True))
    for p in engine.module.parameters():  # nothing may survive from the initialisation
        p.data.zero_()
    path, _ = engine.load_checkpoint(load_dir)
    assert path is not None and engine.global_steps == 3
    return tiny_train(engine, range(3, 6), torch.distributed.get_rank(), gas)


def _save_deepspeed_layout(save_dir: str, stage: int) -> list[float]:
    engine = _engine(_config(stage, 1, layout="deepspeed"))
    rank = torch.distributed.get_rank()
    tiny_train(engine, range(3), rank)
    engine.save_checkpoint(save_dir, tag="global_step3")
    return tiny_train(engine, range(3, 6), rank)


@pytest.mark.parametrize(("world", "stage", "gas"), [(1, 3, 2), (2, 1, 1)])
def test_deepspeed_universal_golden_loads(tmp_path: Path, world: int, stage: int, gas: int) -> None:
    shutil.copytree(GOLDENS / "universal", tmp_path / "uni")
    expected = json.loads((GOLDENS / "universal_losses.json").read_text())["more"]
    got = run_distributed(_load_universal_and_continue, world, str(tmp_path / "uni"), stage, gas)
    for rank in range(world):
        want = [expected[rank * gas + m][i] for i in range(3) for m in range(gas)]
        torch.testing.assert_close(
            torch.tensor(got[rank]), torch.tensor(want), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("stage", [2, 3])
def test_own_ds_to_universal_loads(tmp_path: Path, stage: int) -> None:
    from shardspeed.checkpoint import ds_to_universal

    more = run_distributed(_save_deepspeed_layout, 2, str(tmp_path / "ckpt"), stage)
    args = ds_to_universal.parse_arguments(
        ["--input_folder", str(tmp_path / "ckpt" / "global_step3")]
        + ["--output_folder", str(tmp_path / "uni" / "global_step3")]
    )
    ds_to_universal.main(args)
    assert (tmp_path / "uni" / "latest_universal").read_text() == "global_step3"
    (got,) = run_distributed(_load_universal_and_continue, 1, str(tmp_path / "uni"), 1, 2)
    want = [more[r][i] for i in range(3) for r in range(2)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
