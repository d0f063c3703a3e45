"""Each fused inference op against its Hugging Face / plain PyTorch reference (fp32).

The fused modules change how the math is grouped (one matmul for q/k/v or gate/up, one
rotary pass, SDPA with grouped-query heads), not the math, so outputs must agree to
rounding: 1e-5 absolute on O(1) activations.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from shardspeed.inference.injection import (
    FusedAttention,
    FusedGatedMLP,
    FusedQKV,
    apply_rotary,
    inject_fused_modules,
    sdpa_attention,
)
from shardspeed.inference.injection.attention import causal_mask

tf = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

ATOL = 1e-5
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2)  # fmt: skip


def test_fused_qkv_equals_three_linears() -> None:
    torch.manual_seed(0)
    q, k, v = nn.Linear(32, 48), nn.Linear(32, 16), nn.Linear(32, 16, bias=False)
    fused = FusedQKV(q, k, v)
    x = torch.randn(2, 5, 32)
    got = fused(x)
    for mine, ref in zip(got, (q(x), k(x), v(x))):
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)
    assert fused.weight.shape == (80, 32)


def test_fused_mlp_equals_llama_mlp() -> None:
    torch.manual_seed(0)
    mlp = modeling_llama.LlamaMLP(tf.LlamaConfig(**SMALL))
    fused = FusedGatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(fused(x), mlp(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_fused_rotary_equals_hf(rotary_fraction: float) -> None:
    torch.manual_seed(0)
    q, k = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16)
    dim = int(16 * rotary_fraction)
    angles = torch.randn(2, 5, dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (B, T, d)
    got_q, got_k = apply_rotary(q, k, cos, sin)
    ref_q, ref_k = modeling_llama.apply_rotary_pos_emb(q[..., :dim], k[..., :dim], cos, sin)
    torch.testing.assert_close(got_q[..., :dim], ref_q, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_k[..., :dim], ref_k, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_q[..., dim:], q[..., dim:])  # the rest passes through


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax attention written out: repeat KV heads, mask, softmax, weighted sum."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize(
    "case", ["prefill", "cached_chunk", "decode", "padded_bool", "padded_float", "window"]
)
def test_sdpa_attention_equals_eager(case: str) -> None:
    torch.manual_seed(0)
    q_len, kv_len = {"prefill": (6, 6), "cached_chunk": (3, 7), "decode": (1, 7)}.get(case, (6, 6))
    q = torch.randn(2, 8, q_len, 16)
    k, v = torch.randn(2, 2, kv_len, 16), torch.randn(2, 2, kv_len, 16)
    window = 3 if case == "window" else None
    keep = causal_mask(q_len, kv_len, q.device, window).expand(2, 1, q_len, kv_len).clone()
    mask: Any = None
    if case.startswith("padded"):
        keep[0, :, :, :2] = False  # row 0 is left-padded by two tokens
        keep[0, :, :2, :] = True  # padded queries: attend anywhere (outputs are ignored)
        mask = keep if case == "padded_bool" else torch.zeros(keep.shape).masked_fill(~keep, -1e9)
    got = sdpa_attention(q, k, v, mask, 16**-0.5, window)
    torch.testing.assert_close(got, _eager(q, k, v, keep), atol=ATOL, rtol=0)


def test_causal_mask_is_bottom_right_aligned() -> None:
    assert causal_mask(2, 4, torch.device("cpu")).tolist() == [
        [True, True, True, False],
        [True, True, True, True],
    ]
    assert causal_mask(3, 3, torch.device("cpu"), 2).tolist() == [
        [True, False, False],
        [True, True, False],
        [False, True, True],
    ]


def test_fused_attention_equals_llama_attention_with_cache() -> None:
    torch.manual_seed(0)
    config = tf.LlamaConfig(**SMALL, attention_bias=True)
    attn = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    fused = FusedAttention(attn)
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    x = torch.randn(2, 7, 64)
    caches = (tf.DynamicCache(config=config), tf.DynamicCache(config=config))
    for lo, hi in ((0, 5), (5, 6), (6, 7)):  # prefill 5, then two decode steps
        pos = torch.arange(lo, hi).unsqueeze(0)
        emb = rotary(x, pos)
        chunk = x[:, lo:hi]
        keep = causal_mask(hi - lo, hi, x.device)  # standalone HF attention builds no mask
        additive = torch.zeros(1, 1, hi - lo, hi).masked_fill(~keep, torch.finfo(x.dtype).min)
        ref, _ = attn(chunk, emb, additive, caches[0])
        got, _ = fused(chunk, emb, additive, caches[1])
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert (fused.num_heads, fused.num_key_value_heads) == (8, 2)


MODELS = {
    "llama": lambda: tf.LlamaConfig(**SMALL),
    "qwen2": lambda: tf.Qwen2Config(**SMALL),
    "mistral": lambda: tf.MistralConfig(**SMALL, sliding_window=4),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_injected_model_equals_hf(kind: str) -> None:
    """tp=1 kernel injection: logits and greedy generate of a left-padded batch."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(MODELS[kind]()).eval()
    fused = copy.deepcopy(model)
    assert inject_fused_modules(fused) == {"attention": 2, "mlp": 2}
    ids = torch.randint(2, 64, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            fused(ids, attention_mask=mask).logits[mask.bool()],
            model(ids, attention_mask=mask).logits[mask.bool()],
            atol=1e-4, rtol=0,
        )  # fmt: skip
        gen = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(fused.generate(ids, **gen), model.generate(ids, **gen))


def test_injection_refuses_other_model_types() -> None:
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="replace_with_kernel_inject=True supports model types"):
        inject_fused_modules(model)
