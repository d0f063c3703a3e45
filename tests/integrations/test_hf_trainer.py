"""Hugging Face ``Trainer(deepspeed=ds_config)`` on shardspeed, against plain PyTorch.

Each case runs ``hf_trainer_worker.py`` in a subprocess with the ``deepspeed`` compatibility
distribution on its path: a tiny random 2-layer Llama, 4 optimizer steps of 2 micro-batches
(gradient accumulation 2, clipping on, warm-up 2), once through the Trainer at ZeRO stage 2
or 3 and once as a plain PyTorch loop over the very micro-batches the Trainer fed the model.
Per-micro-batch losses must agree within the fp32 parity tolerance (rtol 1e-5, atol 1e-6);
then a fresh Trainer resumes from ``checkpoint-2`` and must see the same batches and losses
as the uninterrupted run's last two steps.

``_trainer_opt``: the Trainer builds ``torch.optim.AdamW`` (decay / no-decay groups) and a
linear schedule and hands both to ``deepspeed.initialize``. ``_ds_opt``: ``optimizer``
(AdamW) and ``scheduler`` (``WarmupDecayLR``) come from the ds_config with every value
``"auto"``, filled by the Trainer. ``z3_ds_opt`` runs by default (about 15 s on a quiet
machine); the others are marked slow (``make test-slow``), and the Trainer-optimizer path at
stage 2 also runs by default on 2 ranks in ``test_trainer_multiprocess.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TOL = {"rtol": 1e-5, "atol": 1e-6}
LR = 3e-3


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and got
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= TOL["atol"] + TOL["rtol"] * abs(b), (index, a, b)


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("z2_trainer_opt", marks=pytest.mark.slow),  # 2 ranks: multiprocess test
        "z3_ds_opt",
        pytest.param("z3_trainer_opt", marks=pytest.mark.slow),
        pytest.param("z2_ds_opt", marks=pytest.mark.slow),
    ],
)
def test_trainer_matches_plain_pytorch_and_resumes(
    variant: str, run_worker: Callable[..., dict[str, Any]], tmp_path: Path
) -> None:
    result = run_worker("hf_trainer_worker.py", tmp_path, variant)
    assert result["engine"] == "ShardSpeedEngine"
    # 4 optimizer steps x 2 micro-batches, crossing an epoch boundary (6 micro-batches/epoch)
    assert len(result["losses"]) == 8
    _close(result["losses"], result["reference"])
    if variant.endswith("ds_opt"):
        # DeepSpeed's WarmupDecayLR as the Trainer logs it (the rate after each step):
        # iteration i -> log(i+1)/log(2) warm-up, then (4 - i) / 2 decay
        assert result["lr"] == pytest.approx([0.0, LR, LR, LR / 2])
    else:  # Trainer's linear schedule with warm-up 2, logged before its step
        assert result["lr"] == pytest.approx([0.0, LR / 2, LR, LR / 2])
    files = set(result["checkpoint_files"])
    assert {"latest", "trainer_state.json", "rng_state.pth"} <= files
    assert any(name.startswith("global_step2/") for name in files)
    assert "model.safetensors" in files  # at stage 3 via stage3_gather_16bit_weights_on_model_save
    assert "zero_to_fp32.py" in files  # written by save_checkpoint, as DeepSpeed does
    assert result["resumed_batches"] == result["batches"][4:]
    _close(result["resumed_losses"], result["losses"][4:])
