"""memory_breakdown() matches the ZeRO formulas (bf16 + Adam, N=4) and an independent count.

Expected bytes per rank for P parameters (ZeRO paper, K = 12 for Adam's fp32 master,
exp_avg and exp_avg_sq): stage 0: 16P; stage 1: 4P + 12P/N; stage 2: 2P + 14P/N.
Checked within 5%. The independent count sums the storage of every live tensor found by
the garbage collector (deduplicated by storage), which must agree with the breakdown.
"""

from __future__ import annotations

import gc

import pytest
import torch

from shardspeed.models import GPT, GPTConfig
from shardspeed.testing import run_distributed

WORLD = 4


def _live_tensor_bytes() -> int:
    gc.collect()
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
        except Exception:
            continue
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _measure(stage: int) -> tuple[int, dict[str, int], int, int]:
    import shardspeed

    before = _live_tensor_bytes()  # baseline before the model exists
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128))
    num_params = sum(p.numel() for p in model.parameters())
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": stage},
        },
    )
    x = torch.randint(0, 256, (2, 32))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()  # optimizer state exists after the first step
    del x, loss
    breakdown = engine.memory_breakdown()
    live = _live_tensor_bytes() - before
    engine.destroy()
    return num_params, breakdown, live, before


def _all_stages() -> list:
    return [_measure(stage) for stage in (0, 1, 2)]


@pytest.fixture(scope="module")
def measurements() -> list:
    return run_distributed(_all_stages, WORLD, timeout=240)[0]


@pytest.mark.parametrize(
    "stage, formula",
    [
        (0, lambda P, N: 16 * P),
        (1, lambda P, N: 4 * P + 12 * P / N),
        (2, lambda P, N: 2 * P + 14 * P / N),
    ],
)
def test_memory_breakdown_matches_zero_formula(measurements, stage, formula) -> None:
    num_params, breakdown, _, _ = measurements[stage]
    expected = formula(num_params, WORLD)
    model_states = breakdown["total"] - breakdown["buffers"]
    assert abs(model_states - expected) / expected < 0.05, (stage, breakdown, expected)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_breakdown_agrees_with_live_tensor_storage(measurements, stage) -> None:
    _, breakdown, live, _ = measurements[stage]
    # storage alive after initialize + one step, beyond what existed before the model
    assert abs(live - breakdown["total"]) / breakdown["total"] < 0.05, (stage, breakdown, live)


def test_memory_falls_with_stage(measurements) -> None:
    totals = [m[1]["total"] for m in measurements]
    assert totals[0] > totals[1] > totals[2]
