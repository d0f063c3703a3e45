"""The tiny Hugging Face Llama and token rows the integration workers train on."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int, seq: int, vocab: int) -> LlamaForCausalLM:
    """A 2-layer GQA Llama (hidden 32) with eager attention, seeded initial weights."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_rows(seed: int, samples: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """``samples`` random ``{"input_ids", "labels"}`` rows of ``seq`` tokens (labels = ids)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples):
        ids = torch.randint(0, vocab, (seq,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows
