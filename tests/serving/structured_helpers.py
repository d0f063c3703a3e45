"""A real byte-level BPE vocabulary built in memory (no hub) and a tiny random Llama over
it, for the structured-output tests: JSON keys, numbers and punctuation span several
bytes per token, so the masks are tested across token boundaries."""

from __future__ import annotations

import json
import random
from typing import Any

import torch

EOS_TOKEN = "</s>"


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ["name", "age", "city", "tags", "id", "ok", "true", "false", "null", "items"]
    rows = []
    for _ in range(300):
        obj = {rng.choice(words): rng.choice([rng.randint(0, 999), rng.choice(words), True])}
        rows.append(json.dumps(obj))
        rows.append(" ".join(rng.choice(words) for _ in range(8)) + ", 0123456789.")
    return rows


def bpe_tokenizer(vocab_size: int = 400, eos: bool = True) -> Any:
    """A GPT-2-style byte-level BPE ``PreTrainedTokenizerFast`` trained on JSON-like text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN] if eos else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    extra = {"eos_token": EOS_TOKEN} if eos else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **extra)


def tiny_llama(vocab_size: int, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
    )
    return LlamaForCausalLM(cfg).float().eval()
