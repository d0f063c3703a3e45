"""PEFT LoRA through the Hugging Face ``Trainer(deepspeed=ds_config)`` on shardspeed, 2 ranks.

``peft_worker.py`` (``shardspeed --nproc 2``, the ``deepspeed`` compatibility distribution)
trains LoRA adapters (r=4 on ``q_proj``/``v_proj``) of a tiny random Llama for 4 optimizer
steps at ZeRO stage 2 or 3. Only the adapters train, so the Trainer's no-decay group is
empty and reaches ``deepspeed.initialize`` as an empty group, which must be kept (the
optimizer has both groups). Checked: per-micro-batch losses equal a plain PyTorch replay
and DeepSpeed 0.19.8's losses (``tests/goldens/frameworks/peft_*.json``) within rtol 1e-5,
atol 1e-6; ``trainer.save_model`` writes exactly the adapter tensors at full size (at
ZeRO-3 gathered from the partitions); ``PeftModel.from_pretrained`` on a fresh base model
gives the trained engine's logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from framework_goldens import check_golden, close, needs_peers, record_or_compare

VARIANTS = ["lora_z2", "lora_z3"]
# ZeRO 2 in the slow tier (suite time): ZeRO 3, where the adapter is gathered from shards, stays
IN_MAKE_TEST = [pytest.param("lora_z2", marks=pytest.mark.slow), "lora_z3"]


@pytest.mark.parametrize("variant", IN_MAKE_TEST)
def test_lora_trains_saves_and_reloads(
    variant: str,
    run_worker: Callable[..., dict[str, Any]],
    launch: Callable[[int], list[str]],
    tmp_path: Path,
) -> None:
    pytest.importorskip("peft")
    rank0 = run_worker("peft_worker.py", tmp_path, variant, launcher=launch(2))
    rank1 = json.loads((tmp_path / "result_rank1.json").read_text())
    for result in (rank0, rank1):
        assert result["engine"] == "ShardSpeedEngine"
        assert result["world_size"] == result["accelerate_num_processes"] == 2
        sizes = result["optimizer_group_sizes"]  # decay (the LoRA matrices), no-decay (none)
        assert len(sizes) == 2 and sizes[0] >= 1 and sizes[1] == 0, sizes
        assert result["steps"] == [0, 0, 1, 1, 2, 2, 3, 3]
        close(result["losses"], result["reference"])
    check_golden(f"peft_{variant}", [rank0, rank1])

    # PEFT's file names drop the adapter name: "...q_proj.lora_A.default.weight" -> "...lora_A.weight"
    expected = {k.replace(".default.", "."): v for k, v in rank0["expected_shapes"].items()}
    assert rank0["saved_shapes"] == expected
    scale = rank0["reload_max_abs_logit"]
    assert rank0["reload_max_abs_diff"] <= 1e-6  # the same fp32 weights, reloaded
    # the replay's final weights give the same logits (fp32 parity: atol 1e-6, rtol 1e-5)
    assert rank0["reference_logits_max_abs_diff"] <= 1e-6 + 1e-5 * scale


@pytest.mark.slow
@needs_peers
@pytest.mark.parametrize("variant", VARIANTS)
def test_peft_deepspeed_golden(variant: str, tmp_path: Path) -> None:
    record_or_compare(f"peft_{variant}", "peft_worker.py", variant, tmp_path)
