"""ShardSpeed checkpoints in DeepSpeed's layout, without DeepSpeed.

ShardSpeed (2 gloo ranks, parity GPT, AdamW + WarmupLR) trains 3 steps at ZeRO 1, 2 or 3,
saves with ``"checkpoint": {"layout": "deepspeed"}`` and trains 3 more (the uninterrupted
run). Then:

* the tag holds DeepSpeed's files; PyTorch Lightning's reads (``get_optim_files``,
  ``get_model_state_file``, plain ``torch.load``) find ``zero_stage`` and the client state,
  and ``get_fp32_state_dict_from_zero_checkpoint`` equals the weights at save (bitwise);
* with the native files deleted, ShardSpeed loads DeepSpeed's files alone at world 2 (same
  stage) and world 1 (ZeRO 1, GAS 2: the same global batch) and continues with the
  uninterrupted run's losses (1e-5);
* the continued losses equal real DeepSpeed 0.19.8's after it loaded the same checkpoint,
  as recorded in ``tests/goldens/deepspeed_layout/losses.json`` by
  ``test_checkpoint_deepspeed_layout_oracle.py`` (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspeed_layout_common import MORE_STEPS, SAVED_STEPS, config, shardspeed_save_and_continue
from parity_common import ParitySpec, make_model, micro_batch

from shardspeed.testing import run_distributed

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "deepspeed_layout" / "losses.json"


def _load_and_continue(ckpt: str, stage: int, gas: int) -> list[float]:
    """Load the folder into a differently seeded engine; train the same batches on."""
    import shardspeed

    rank = torch.distributed.get_rank()
    model = make_model(ParitySpec(seed=999))
    cfg = {**config(stage), "gradient_accumulation_steps": gas}
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None and client["epoch"] == 3
    assert (engine.global_steps, engine.global_samples) == (SAVED_STEPS, 4 * SAVED_STEPS)
    losses = []
    spec = ParitySpec(world=2)
    for step in range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS):
        for micro in range(gas):
            x, y = micro_batch(spec, step, rank * gas + micro)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.item()))
    return losses


def _lightning_reads(ckpt: Path) -> dict:
    """What ``lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict``
    reads, through ShardSpeed's ``deepspeed.utils.zero_to_fp32`` (plain ``torch.load``)."""
    from shardspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        get_model_state_file,
        get_optim_files,
    )

    state_dict = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    tag_dir = ckpt / (ckpt / "latest").read_text().strip()
    optim = torch.load(get_optim_files(tag_dir)[0], map_location="cpu", weights_only=False)
    zero_stage = optim["optimizer_state_dict"]["zero_stage"]
    client = torch.load(
        get_model_state_file(tag_dir, zero_stage), map_location="cpu", weights_only=False
    )
    return {"state_dict": state_dict, "zero_stage": zero_stage, "client": client}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_layout_save_read_resume(tmp_path: Path, stage: int) -> None:
    ckpt = tmp_path / "ckpt"
    ours = run_distributed(shardspeed_save_and_continue, 2, str(ckpt), stage, "fp32", timeout=300)
    tag_dir = ckpt / "global_step3"
    model_files = (
        ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
        if stage == 3
        else ["mp_rank_00_model_states.pt"]
    )
    optim_files = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    assert {f.name for f in tag_dir.glob("*.pt")} == set(model_files + optim_files)

    from shardspeed.checkpoint import DeepSpeedCheckpoint

    inspected = DeepSpeedCheckpoint(str(tag_dir))
    assert (inspected.dp_degree, inspected.tp_degree, inspected.pp_degree) == (2, 1, 1)
    assert inspected.zero_stage == stage and inspected.get_iteration() == SAVED_STEPS

    read = _lightning_reads(ckpt)
    assert read["zero_stage"] == stage
    assert read["client"]["epoch"] == 3 and read["client"]["global_steps"] == SAVED_STEPS
    weights = ours[0]["weights"]
    assert set(read["state_dict"]) == set(weights) | {"lm_head.weight"}
    for name, value in weights.items():
        assert torch.equal(read["state_dict"][name], value), name

    for f in [*tag_dir.glob("rank*"), tag_dir / "manifest.json"]:
        f.unlink()  # DeepSpeed's files alone from here on
    only_ds = _lightning_reads(ckpt)["state_dict"]
    for name, value in weights.items():
        torch.testing.assert_close(only_ds[name], value, rtol=0, atol=0)
    again = run_distributed(_load_and_continue, 2, str(ckpt), stage, 1, timeout=300)
    for rank in range(2):
        torch.testing.assert_close(
            torch.tensor(again[rank]), torch.tensor(ours[rank]["more"]), rtol=1e-5, atol=1e-5
        )
    if stage == 2:  # another world size and stage: world 1, ZeRO 1, GAS 2
        (one,) = run_distributed(_load_and_continue, 1, str(ckpt), 1, 2, timeout=300)
        expected = [ours[r]["more"][i] for i in range(MORE_STEPS) for r in range(2)]
        torch.testing.assert_close(torch.tensor(one), torch.tensor(expected), rtol=1e-5, atol=1e-5)

    golden = json.loads(GOLDEN.read_text())[f"zero{stage}_fp32"]
    for rank in range(2):  # real DeepSpeed 0.19.8 continuing from the same checkpoint
        torch.testing.assert_close(
            torch.tensor(ours[rank]["more"]), torch.tensor(golden[rank]), rtol=1e-5, atol=1e-5
        )


def test_deepspeed_layout_refuses_stage0(tmp_path: Path) -> None:
    (err,) = run_distributed(_save_stage0, 1, str(tmp_path), timeout=120)
    assert "ZeRO stage 0" in err and '"layout": "native"' in err


def _save_stage0(save_dir: str) -> str:
    import shardspeed

    model = make_model(ParitySpec())
    cfg = {**config(0), "checkpoint": {"layout": "deepspeed"}}
    engine, *_ = shardspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with pytest.raises(ValueError) as info:
        engine.save_checkpoint(save_dir)
    return str(info.value)


def test_layout_partition_math() -> None:
    from shardspeed.checkpoint.deepspeed_layout import stage3_sub_groups, zero12_partitions

    parts = zero12_partitions(13, 2)  # aligned to 16: 8 + 8, the last 3 are padding
    assert [(p.start, p.size, p.padding) for p in parts] == [(0, 8, 0), (8, 8, 3)]
    assert [p.padding for p in zero12_partitions(3, 4)] == [0, 1, 2, 2]
    assert stage3_sub_groups([10, 10, 10], 2, 1_000_000_000) == [[0, 1, 2]]
    assert stage3_sub_groups([10, 10, 10], 2, 9) == [[0, 1], [2]]
