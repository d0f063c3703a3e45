"""Cleaned models served: ``redundancy_clean``'s quantized weights load into the int8 / int4
weight-only layers exactly (the grid is kept, not re-rounded), and FastGen's ``pipeline()``
generates the same greedy tokens as the cleaned model itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shardspeed.compression import init_compression, redundancy_clean, set_weight_group_size
from shardspeed.inference.quantization import QuantizedLinear, WeightQuantConfig
from shardspeed.inference.quantization.qtensor import dequantize_weight, quantize_weight
from shardspeed.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_compression_basic_layer import wq_config  # noqa: E402


def _config(bits: int) -> dict:
    return wq_config(bits, r"h\.\d+\.")  # every linear of the blocks


def _cleaned_gpt(bits: int, group_size: int | None) -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    init_compression(gpt, _config(bits))
    assert set_weight_group_size(gpt, group_size) == 8
    return redundancy_clean(gpt, _config(bits))


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 32)])
def test_cleaned_weights_load_exactly(bits, group_size):
    gpt = _cleaned_gpt(bits, group_size)
    for name, module in gpt.named_modules():
        if name.startswith("h.") and isinstance(module, torch.nn.Linear):
            w = module.weight.data
            qw = quantize_weight(w, bits, group_size, symmetric=True)
            torch.testing.assert_close(dequantize_weight(qw), w, rtol=1e-6, atol=0)


def test_grid_detection_hand_values():
    # int4, one group: 4-bit symmetric grid of step 0.5, negative extreme -8 * 0.5
    w = torch.tensor([[-4.0, 3.5, 0.0, -0.5]])
    qw = quantize_weight(w, 4, None, symmetric=True)
    assert qw.scales.tolist() == [[0.5]] and dequantize_weight(qw).tolist() == w.tolist()
    # int8, positive extreme 127 * 0.25 -> step 0.25 kept (plain rounding would use 31.75/127)
    w8 = torch.tensor([[31.75, -0.25, 1.0, 0.0]])
    q8 = quantize_weight(w8, 8, None, symmetric=True)
    assert q8.scales.tolist() == [[0.25]] and q8.int_values().tolist() == [[127, -1, 4, 0]]
    # off the grid: the usual absmax / 127 step
    off = torch.tensor([[1.0, 0.3, -0.7, 0.1]])
    assert quantize_weight(off, 8, None, symmetric=True).scales.item() == pytest.approx(1 / 127)


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 32)])
def test_pipeline_serves_cleaned_model_token_exact(tmp_path, bits, group_size):
    from shardspeed.inference.serving.pipeline import pipeline

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # restored: later tests in this process keep the default
    try:
        _serve_cleaned(tmp_path, bits, group_size, pipeline)
    finally:
        torch.set_num_threads(threads)


def _serve_cleaned(tmp_path, bits, group_size, pipeline) -> None:
    gpt = _cleaned_gpt(bits, group_size)
    gpt.save_pretrained(tmp_path / "ckpt")
    prompts = [[5, 9, 17, 33, 2], [7, 7, 8]]
    with torch.no_grad():
        refs = [
            gpt.generate(torch.tensor([p]), 10, temperature=0)[0, len(p) :].tolist()
            for p in prompts
        ]
    config = WeightQuantConfig(bits=bits, group_size=group_size, kernel="reference")
    pipe = pipeline(tmp_path / "ckpt", quantization=config, block_size=4, num_blocks=64)
    layers = [m for m in pipe.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 and {m.meta.bits for m in layers} == {bits}
    got = [r.token_ids for r in pipe(prompts, max_new_tokens=10, ignore_eos=True)]
    assert got == refs


def test_init_inference_int8_keeps_the_cleaned_grid():
    """init_inference(dtype=int8) casts to fp16 and packs bf16 scales for torch's kernel:
    the stored int8 codes are still exactly the cleaned weights' grid indices."""
    import shardspeed

    gpt = _cleaned_gpt(8, None)
    cleaned = {
        n: m.weight.detach().clone()
        for n, m in gpt.named_modules()
        if n.startswith("h.") and isinstance(m, torch.nn.Linear)
    }
    engine = shardspeed.init_inference(gpt, dtype=torch.int8, keep_module_on_host=True)
    layers = {n: m for n, m in engine.module.named_modules() if isinstance(m, QuantizedLinear)}
    assert sorted(layers) == sorted(cleaned)  # the 8 linears of the blocks
    for name, layer in layers.items():
        codes = quantize_weight(cleaned[name], 8, None, symmetric=True).int_values()  # fp32 grid
        (stored,) = [b for b in layer.buffers() if b.dtype == torch.int8]
        assert torch.equal(stored.to(torch.int32).reshape(codes.shape), codes), name
