"""``shardspeed --nproc 2 train.py`` with the Hugging Face Trainer on a CPU-only machine.

What Accelerate needs: on a host without GPUs it only counts the launched processes when
told the job is a CPU job, i.e. ``TrainingArguments(use_cpu=True)`` (``--use_cpu`` on an HF
script's command line), or ``accelerate.PartialState(cpu=True)`` before the
``Accelerator`` in a plain Accelerate script. Without it Accelerate sees one process, fills
``train_batch_size`` for one, and shardspeed refuses the inconsistent batch triple with a
message naming the flag. (The ``ACCELERATE_USE_CPU`` variable is no substitute: Accelerate
then drops DeepSpeed and runs DDP.)

The 2-rank test runs ``hf_trainer_worker.py`` (ZeRO-2, the Trainer's own ``AdamW`` and
linear schedule; ``test_hf_trainer.py`` covers ZeRO-3 with the ds_config's) under the launcher: both engines must be data-parallel
over 2 ranks, the ranks must see different samples, and every rank's per-micro-batch losses
must equal a plain PyTorch replay of both ranks' batches (gradients summed, divided by 2)
within fp32 parity (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardspeed.config.base import ConfigError
from shardspeed.config.batch import resolve_batch_triple

TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_trainer_shards_over_two_cpu_ranks(
    run_worker: Callable[..., dict[str, Any]], launch: Callable[[int], list[str]], tmp_path: Path
) -> None:
    rank0 = run_worker(
        "hf_trainer_worker.py", tmp_path, "z2_trainer_opt", "--no-resume", launcher=launch(2)
    )
    rank1 = json.loads((tmp_path / "result_rank1.json").read_text())
    for result in (rank0, rank1):
        assert result["engine"] == "ShardSpeedEngine"
        assert result["dp_world_size"] == 2 and result["accelerate_num_processes"] == 2
        # 12 samples / (2 ranks * 2 per micro-batch) = 3 micro-batches an epoch on each rank:
        # windows of 2 and 1 micro-batches, 4 steps = 2 epochs
        assert len(result["losses"]) == 6
        for a, b in zip(result["losses"], result["reference"], strict=True):
            assert abs(a - b) <= TOL["atol"] + TOL["rtol"] * abs(b), (a, b)
    first_epoch = [
        {tuple(row) for batch in result["batches"][:3] for row in batch}
        for result in (rank0, rank1)
    ]
    assert len(first_epoch[0]) == len(first_epoch[1]) == 6
    assert not first_epoch[0] & first_epoch[1]  # a distributed sampler split the data


def test_batch_filled_for_one_process_names_the_cpu_flag() -> None:
    """What a Trainer without ``use_cpu`` on a CPU host gets (Accelerate counted 1 process)."""
    with pytest.raises(ConfigError, match=r"use_cpu=True") as info:
        resolve_batch_triple(4, 2, 2, dp_world_size=2)
    assert "PartialState(cpu=True)" in str(info.value)
    with pytest.raises(ConfigError) as other:  # a plain mismatch: no Accelerate hint
        resolve_batch_triple(6, 2, 2, dp_world_size=2)
    assert "use_cpu" not in str(other.value)
