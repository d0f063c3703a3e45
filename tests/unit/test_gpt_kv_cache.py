"""The demo GPT's KV-cached decoding equals recomputing the whole sequence every step."""

from __future__ import annotations

import pytest
import torch

from shardspeed.models.gpt import GPT, GPTConfig


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))
    return model.eval()


def test_cached_logits_match_full_recompute() -> None:
    model = _model()
    idx = torch.randint(0, 64, (3, 20))
    full, _ = model(idx)  # (B, T, V)
    cache = model.new_cache(3)
    prefill, _ = model(idx[:, :7], cache=cache)
    chunk, _ = model(idx[:, 7:12], cache=cache)  # several new tokens against a filled cache
    steps = [model(idx[:, t : t + 1], cache=cache)[0] for t in range(12, 20)]
    cached = torch.cat([prefill, chunk, *steps], dim=1)
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_with_cache_equals_without(temperature: float) -> None:
    model = _model(1)
    idx = torch.randint(0, 64, (2, 5))
    torch.manual_seed(7)
    cached = model.generate(idx, 12, temperature=temperature, top_k=10)
    torch.manual_seed(7)
    plain = model.generate(idx, 12, temperature=temperature, top_k=10, use_cache=False)
    assert torch.equal(cached, plain)


def test_generate_past_block_size_falls_back_to_the_window() -> None:
    model = _model(2)
    idx = torch.randint(0, 64, (1, 30))
    out = model.generate(idx, 6, temperature=0.0)  # 36 > block_size 32: sliding window
    assert out.shape == (1, 36)
    assert torch.equal(out, model.generate(idx, 6, temperature=0.0, use_cache=False))


def test_cache_overflow_is_refused() -> None:
    model = _model()
    cache = model.new_cache(1)
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="block_size=32"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
