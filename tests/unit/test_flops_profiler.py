"""Flops profiler: counts equal the analytic formulas; the report shows the module tree."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.profiling import Timers
from shardspeed.profiling.flops_profiler import (
    FlopsProfiler,
    get_model_profile,
    mfu,
    peak_bf16_flops,
)


def _linear_stack() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 10)
    )


def test_linear_stack_matches_analytic_count():
    torch.manual_seed(0)
    model = _linear_stack()
    batch = 8
    flops, macs, params = get_model_profile(
        model, input_shape=(batch, 64), print_profile=False, as_string=False
    )
    matmul_macs = batch * (64 * 128 + 128 * 32 + 32 * 10)
    relu_flops = batch * (128 + 32)  # 1 FLOP per output element
    assert macs == matmul_macs
    assert flops == 2 * matmul_macs + relu_flops
    assert abs(flops - 2 * matmul_macs) / flops < 0.01  # the matmuls dominate
    assert params == sum(p.numel() for p in model.parameters())


def _gpt_analytic(cfg: GPTConfig, batch: int, seq: int) -> dict[str, int]:
    tokens = batch * seq
    c, layers = cfg.n_embd, cfg.n_layer
    linear = 2 * tokens * (c * 3 * c + c * c + c * 4 * c + 4 * c * c) * layers  # per-block Linears
    lm_head = 2 * tokens * c * cfg.vocab_size
    head_dim = c // cfg.n_head
    sdpa = layers * 2 * (2 * batch * cfg.n_head * seq * seq * head_dim)  # QK^T and PV
    layer_norm = (2 * layers + 1) * 5 * tokens * c  # affine LayerNorm: 5 per element
    gelu = layers * tokens * 4 * c
    adds = (1 + 2 * layers) * tokens * c  # token + position embedding, two residuals per block
    return {
        "matmul": linear + lm_head,
        "sdpa": sdpa,
        "total": linear + lm_head + sdpa + layer_norm + gelu + adds,
    }


def test_demo_gpt_matches_analytic_count_and_prints_tree(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    model = GPT(cfg).eval()
    batch, seq = 2, 32
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))

    prof = FlopsProfiler(model)
    with torch.no_grad():
        prof.start_profile()
        model(idx)
        prof.stop_profile()
    expected = _gpt_analytic(cfg, batch, seq)
    total = prof.get_total_flops()
    assert abs(total - expected["total"]) / expected["total"] < 0.01
    by_op = prof.get_flops_by_op()
    assert by_op.get("addmm", 0) + by_op.get("mm", 0) == expected["matmul"]
    sdpa = sum(v for k, v in by_op.items() if "scaled_dot_product" in k)
    assert sdpa == expected["sdpa"]
    assert prof.get_total_params() == model.num_parameters()
    assert prof.get_total_duration() > 0

    out = tmp_path / "profile.txt"
    text = prof.print_model_profile(module_depth=-1, top_modules=2, output_file=str(out))
    assert out.read_text() == text
    # Every module appears, with params / MACs / FLOPs / latency and percentages.
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("c_fc (Linear)"))
    fc_flops = 2 * batch * seq * cfg.n_embd * 4 * cfg.n_embd
    assert re.search(r"\d+(\.\d+)? K \(\d+\.\d+%\)", line)  # params and share
    assert f"{fc_flops / 1e6:.2f} MFLOPs ({100 * fc_flops / total:.2f}%)" in line
    assert re.search(r"\d+\.\d+ (us|ms|s) \(\d+\.\d+%\)", line)  # latency and share
    assert "FLOP/s" in line
    assert text.count("(Block)") == cfg.n_layer
    root = next(ln for ln in text.splitlines() if ln.startswith("GPT (GPT)"))
    assert "(100.00%)" in root
    assert "fwd FLOPs per GPU" in text and "MFU" in text
    # A container that is never called (ModuleList) reports the sum of its children.
    assert prof.module_totals(model.h).flops == sum(prof.module_totals(b).flops for b in model.h)

    shallow = prof.print_model_profile(module_depth=1, detailed=True)
    assert "(Block)" not in shallow and "h (ModuleList)" in shallow
    prof.end_profile()
    assert prof.get_total_flops() == 0


def test_get_model_profile_strings_args_ignore_and_errors():
    torch.manual_seed(0)
    model = _linear_stack()
    x = torch.randn(4, 64)
    flops, macs, params = get_model_profile(model, args=[x], print_profile=False)
    assert (
        flops.endswith("FLOPs") and macs.endswith("MACs") and params == "12.78 K"
    )  # 12,778 parameters

    full, _, _ = get_model_profile(model, args=[x], print_profile=False, as_string=False)
    ignored, _, _ = get_model_profile(
        model, args=[x], print_profile=False, as_string=False, ignore_modules=[nn.ReLU]
    )
    assert full - ignored == 4 * (128 + 32)

    with pytest.raises(ValueError, match="mode='backward'"):
        get_model_profile(model, args=[x], mode="backward")
    with pytest.raises(ValueError, match="needs inputs"):
        get_model_profile(model)


def test_conv_and_training_summary_with_engine_timers():
    conv = nn.Sequential(nn.Conv2d(3, 8, kernel_size=3, padding=1))
    x = torch.randn(2, 3, 16, 16)

    class FakeEngine:
        world_size = 1
        mp_world_size = 1
        dp_world_size = 1
        timers = Timers()

        def train_micro_batch_size_per_gpu(self) -> int:
            return 2

    engine = FakeEngine()
    for name, ms in (("forward", 0.010), ("backward", 0.020), ("step", 0.005)):
        engine.timers(name).start()
        engine.timers(name)._start -= ms  # pretend the interval took `ms` seconds
        engine.timers(name).stop()

    prof = FlopsProfiler(conv, ds_engine=engine, recompute_fwd_factor=1.0)
    with torch.no_grad():
        prof.start_profile()
        conv(x)
        prof.stop_profile()
    expected_macs = 2 * 8 * 16 * 16 * 3 * 3 * 3
    assert prof.get_total_macs() == expected_macs
    assert prof.get_total_flops() == 2 * expected_macs
    text = prof.print_model_profile()
    assert "bwd FLOPs per GPU (3 x fwd)" in text
    assert "micro batch size per GPU:" in text
    assert re.search(r"iter latency \(fwd \+ bwd \+ step\):\s+35\.\d\d ms", text)


def test_peak_table_and_mfu():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert peak_bf16_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert peak_bf16_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_bf16_flops("Some CPU") is None
    assert mfu(156e12, "NVIDIA A100-SXM4-40GB") == pytest.approx(0.5)
    assert mfu(1e12, "unknown") is None
