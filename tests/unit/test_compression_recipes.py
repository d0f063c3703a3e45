"""The recipes of ``examples/compression/`` (ZeroQuant PTQ + LKD, XTC) on a tiny GPT, a few
steps each: they run, and what they leave is what they claim (weights on the 4-bit grid,
ternary groups, half the layers copied from the chosen teacher layers)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardspeed.compression import redundancy_clean
from shardspeed.inference.quantization.qtensor import dequantize_weight, quantize_weight
from shardspeed.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "compression"))

from common import linear_names, model_bytes  # noqa: E402
from xtc_gpt import distill  # noqa: E402
from zeroquant_gpt import layerwise_distill, quantize  # noqa: E402


def _teacher() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()


def test_zeroquant_w4a8_lkd_leaves_weights_on_the_int4_grid():
    teacher = _teacher()
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    student, config = quantize(teacher, 4, 16, 8)
    before = student.h[0].attn.c_attn.weight.detach().clone()
    losses = layerwise_distill(student, teacher, tokens, steps=2, batch=2)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(student.h[0].attn.c_attn.weight, before)  # LKD trained block 0
    redundancy_clean(student, config)
    for name in linear_names(student):
        w = student.get_submodule(name).weight.detach()
        qw = quantize_weight(w, 4, 16, symmetric=True)
        torch.testing.assert_close(dequantize_weight(qw), w, rtol=1e-6, atol=0)
    # 8 linears' weights at 4 bits + fp16 scales per 16 columns; the rest fp32
    w4 = model_bytes(student, dict.fromkeys(linear_names(student), 4), 16)
    linear_numel = sum(student.get_submodule(n).weight.numel() for n in linear_names(student))
    expected = model_bytes(teacher, {}, None) - linear_numel * 4 + linear_numel // 2
    expected += 2 * linear_numel // 16
    assert w4 == expected


def test_xtc_keeps_chosen_layers_and_ternary_weights():
    teacher = _teacher()
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    student, config = distill(
        teacher, [1], 2, 16, fp_steps=1, steps=3, batch=2, log_every=10, train_tokens=tokens
    )
    assert student.config.n_layer == 1
    redundancy_clean(student, config)
    weight = student.h[0].mlp.c_fc.weight.detach()  # (128, 32): groups of 16 columns
    for group in weight.reshape(-1, 16):
        values = torch.unique(group.abs())
        assert len(values) <= 2  # {0, a}
    # LN weights were copied from teacher block 1 and trained only a few tiny steps
    torch.testing.assert_close(
        student.h[0].ln_1.weight, teacher.h[1].ln_1.weight, atol=1e-2, rtol=0
    )
