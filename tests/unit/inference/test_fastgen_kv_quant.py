"""Quantized KV cache (``kv_cache_dtype`` int8 / fp8): round-trip error bounds, ~2x the
blocks of a bf16 cache in the same bytes (scales counted), greedy tokens of fp32 KV on a
short prompt, prefix caching and forks over quantized blocks, refused combinations."""

from __future__ import annotations

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.kv_quant import dequantize, quantize
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.models.gpt import GPT, GPTConfig
from shardspeed.models.tokenizer import ByteTokenizer

HEAD_DIM = 64


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=128, n_head=2, block_size=128))  # head_dim 64


def _engine(model: GPT, **config) -> InferenceEngine:
    config = {"block_size": 4, "num_blocks": 64, **config}
    return InferenceEngine.from_pretrained(model, tokenizer=ByteTokenizer(), device="cpu", **config)


@pytest.mark.parametrize("kind, rel", [("int8", 0.5 / 127), ("fp8", 0.07)])
def test_round_trip_error_is_bounded_per_head(kind, rel):
    x = torch.randn(40, 2, HEAD_DIM) * torch.logspace(-3, 2, 40).view(40, 1, 1)  # [N, H, D]
    x[3, 1] = 0.0  # an all-zero head
    q, scale = quantize(x, kind)
    assert scale.shape == (40, 2) and scale.dtype == torch.float16
    back = dequantize(
        q.view(torch.uint8).view(q.dtype) if kind == "int8" else q, scale, torch.float32
    )
    amax = x.abs().amax(dim=-1, keepdim=True)  # [N, H, 1]
    assert ((back - x).abs() <= rel * amax + 1e-6).all()
    assert (back[3, 1] == 0).all()


def test_int8_holds_about_twice_the_tokens_of_bf16_in_the_same_bytes():
    model = _gpt()
    budget = 2**20
    bf16 = _engine(model, num_blocks=None, kv_cache_memory=budget, dtype="bf16")
    int8 = _engine(
        model, num_blocks=None, kv_cache_memory=budget, dtype="bf16", kv_cache_dtype="int8"
    )
    fp32 = _engine(model, num_blocks=None, kv_cache_memory=budget)
    n_bf16, n_int8 = bf16.block_pool.num_blocks, int8.block_pool.num_blocks
    # a slot costs head_dim + 2 (fp16 scale) bytes per head against 2 * head_dim in bf16
    assert n_int8 == budget // (2 * 2 * 4 * 2 * (HEAD_DIM + 2))
    assert n_int8 / n_bf16 >= 1.9 and n_int8 / fp32.block_pool.num_blocks >= 3.8
    used = sum(
        t.numel() * t.element_size() for t in int8.kv_cache.k_values + int8.kv_cache.v_values
    )
    used += sum(
        t.numel() * t.element_size() for t in int8.kv_cache.k_scales + int8.kv_cache.v_scales
    )
    assert used == n_int8 * int8.kv_cache.spec.bytes_per_block <= budget


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_greedy_tokens_match_fp32_kv_and_prefix_cache_and_forks_work(kind):
    model = _gpt()
    prompts = ["The quick brown fox", "def main():\n    return"]
    greedy = SamplingParams(max_new_tokens=12)
    ref = [o.output_token_ids for o in _engine(model).generate(prompts, greedy)]
    quant = _engine(model, kv_cache_dtype=kind)
    got = [o.output_token_ids for o in quant.generate(prompts, greedy)]
    if kind == "int8":
        assert got == ref
    else:  # 3 mantissa bits: report how far the tokens agree
        assert sum(a == b for a, b in zip(got[0], ref[0])) >= 4, (got, ref)
    cached = _engine(model, kv_cache_dtype=kind, enable_prefix_caching=True)
    twice = cached.generate(prompts + prompts, greedy)
    assert [o.output_token_ids for o in twice] == got + got
    assert cached.stats().prefix_cache_hit_blocks > 0
    forks = quant.generate(["fork me"], SamplingParams(max_new_tokens=6, n=3, temperature=1.0))
    assert len(forks) == 3 and all(len(o.output_token_ids) == 6 for o in forks)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"kv_cache_dtype": "int4"}, "choose one of"),
        ({"kv_cache_dtype": "int8", "compile_decode": True}, "compile_decode"),
        ({"kv_cache_dtype": "int8", "attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_refused_combinations_name_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        _engine(_gpt(), **config)
