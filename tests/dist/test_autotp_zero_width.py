"""AutoTP with fewer KV heads than tensor ranks: zero-width shards, as DeepSpeed 0.19.8 has them.

A Llama with 2 KV heads at ``autotp_size`` 4 gives tensor ranks 0-1 one KV-head group each
and ranks 2-3 none: their q/k/v (column) and o_proj (row) shards have width 0, they add
zeros to the row-parallel sum, and the model computes exactly the one-process math.
DeepSpeed trains this layout; so must we, with the same shards and losses.

* Oracle: the DeepSpeed client script of ``test_autotp_deepspeed_losses`` at tp=4 -- same
  per-step losses (2e-5 relative) and every rank's parameter shapes equal to DeepSpeed's
  (recorded in ``tests/goldens/autotp/``; live too where the peers venv has DeepSpeed).
* Parity and checkpoints (no DeepSpeed): tp=4 at ZeRO 1 saved and resumed at tp=1 (dp=2,
  ZeRO 3), and tp=4 at ZeRO 3 resumed at the same layout; losses and final weights match a
  one-process run (``test_tp_checkpoint._run_matrix``); the tp=4 checkpoint consolidates to
  the same full tensors as its tp=1 re-save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from goldens import deepspeed_oracle as golden
from test_autotp_deepspeed_losses import LLAMA, RTOL, deepspeed_run, ours_run
from test_tp_checkpoint import _run_matrix

pytest.importorskip("transformers")

TP = 4
ZERO_WIDTH = ("q_proj", "k_proj", "v_proj", "o_proj")


def _oracle(source: str, stage: int, tmp_path: Path) -> None:
    assert LLAMA["num_key_value_heads"] < TP
    theirs = deepspeed_run(source, stage, TP, tmp_path)
    ours = ours_run(stage, TP)[1]
    for rank, (mine, ds) in enumerate(zip(ours, theirs)):
        assert mine["shapes"] == ds["shapes"], f"rank {rank}: shard shapes differ from DeepSpeed"
        assert mine["numel"] == ds["numel"], (rank, mine["numel"], ds["numel"])
        worst = max(abs(a - b) / abs(b) for a, b in zip(mine["losses"], ds["losses"]))
        assert worst <= RTOL, f"z{stage} rank {rank}: ours {mine['losses']} vs {ds['losses']}"
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [r["shapes"][q][0] for r in ours] == [16, 16, 0, 0]  # the layout under test


# Suite time: AutoTP against DeepSpeed's losses runs in make test at tp 2
# (test_autotp_deepspeed_losses.py) and the zero-width layout's parity and resharding below
@pytest.mark.slow
@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
def test_zero_width_autotp_matches_deepspeed_losses(source: str, tmp_path: Path) -> None:
    _oracle(source, 1, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("source", golden.ORACLE_SOURCES)
@pytest.mark.parametrize("stage", [0, 2])
def test_zero_width_autotp_matches_deepspeed_losses_other_stages(
    source: str, stage: int, tmp_path: Path
) -> None:
    _oracle(source, stage, tmp_path)


def test_zero_width_autotp_trains_and_reshards(tmp_path: Path) -> None:
    """(tp, dp, stage): tp4 ZeRO-1 -> tp1 dp2 ZeRO-3, and tp4 ZeRO-3 exact resume."""
    _run_matrix(tmp_path, "llama", [((TP, 1, 1), (1, 2, 3)), ((TP, 1, 3), (TP, 1, 3))])
    # consolidation in one process: the tp4 checkpoint (no files for empty shards) gives the
    # full tensors, equal to those of its tp1 re-save
    from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint

    tp4 = get_fp32_state_dict_from_checkpoint(str(tmp_path / "llama-tp4dp1s1"))
    tp1 = get_fp32_state_dict_from_checkpoint(str(tmp_path / "llama-tp4dp1s1-to-tp1dp2s3"))
    assert tp4["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    assert set(tp4) == set(tp1)
    for name, tensor in tp1.items():
        assert torch.equal(tp4[name], tensor), name
