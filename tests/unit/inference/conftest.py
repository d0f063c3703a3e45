"""Fixtures for the FastGen engine tests: tiny random models and HF references."""

from __future__ import annotations

import pytest
import torch
from fastgen_helpers import MAX_NEW, VOCAB, hf_greedy, make_prompts


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The CI box has 2 cores shared by many workers: oversubscribed threads cost 50x here."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="session")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="session")
def llama_refs(tiny_llama, prompts) -> list[list[int]]:
    return hf_greedy(tiny_llama, prompts, MAX_NEW)
