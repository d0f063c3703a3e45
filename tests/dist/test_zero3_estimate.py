"""ZeRO-3 memory estimates agree with the engine's accounting (single process, no ranks)."""

from __future__ import annotations

import pytest
import torch

from shardspeed.models import GPT, GPTConfig
from shardspeed.zero.estimate import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_live,
)


def test_estimate_formula_and_offload_moves_12_bytes_per_param_to_host() -> None:
    gpu, host = estimate_zero3_model_states_mem_needs(8_000, 1_000, num_gpus_per_node=4)
    assert (gpu, host) == (16 * 8_000 // 4 + 4 * 1_000, 0)
    gpu_off, host_off = estimate_zero3_model_states_mem_needs(8_000, 1_000, 4, 1, True)
    assert gpu - gpu_off == 12 * 8_000 // 4
    assert host_off == 16 * 8_000  # 16 P / N per GPU, 4 GPUs on the node


def test_estimate_all_live_uses_units_of_the_model() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    rows = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.h[0].parameters())
    assert rows[0]["gpu_bytes"] == int(16 * total / 2 + 4 * block)
    assert rows[1]["host_bytes"] == pytest.approx(16 * total, abs=1)


def test_estimate_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="num_gpus_per_node=0"):
        estimate_zero3_model_states_mem_needs(10, 1, num_gpus_per_node=0)
