"""Tiny HF models and PEFT adapters for the LoRA tests (random, nonzero ``lora_B``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from tests.unit.inference.fastgen_helpers import hf_greedy as hf_greedy  # re-exported

VOCAB = 128


def tiny_llama(model_type: str = "llama") -> Any:
    """A 2-layer random Llama-family model (``llama`` / ``qwen2`` / ``mistral``), fp32."""
    import transformers

    torch.manual_seed(0)
    cls = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[model_type]
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=None,
    )  # fmt: skip
    return getattr(transformers, f"{cls}ForCausalLM")(cfg).float().eval()


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).float().eval()


def make_adapter(
    base: Any, path: Path, targets: list[str], seed: int, rank: int = 4, **lora_kwargs: Any
) -> Any:
    """Save a PEFT adapter of ``base`` with random A and B to ``path``; returns the merged
    HF model (``merge_and_unload``), the reference for this adapter's tokens."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base)
    fan_in_fan_out = model.config.model_type == "gpt2"
    cfg = LoraConfig(
        r=rank, lora_alpha=lora_kwargs.pop("lora_alpha", 2 * rank), target_modules=targets,
        fan_in_fan_out=fan_in_fan_out, lora_dropout=0.0, **lora_kwargs,
    )  # fmt: skip
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(str(path))
    return peft_model.merge_and_unload().eval()


def prompts(n: int, seed: int = 1, lo: int = 3, hi: int = 20) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in lens]
