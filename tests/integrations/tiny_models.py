"""The tiny Hugging Face Llama, tokenizer and token rows the integration workers train on."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Split
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


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


WORDS = 56  # word tokens "w0".."w55"; ids 0..3 are the special tokens below


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w0 .. w55`` built in memory (no hub): ids 0-3 are
    ``<pad> <unk> <s> </s>``, ``wK`` is id ``K + 4``; vocabulary 60, fits ``tiny_llama(vocab=64)``."""
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {token: index for index, token in enumerate(specials)}
    vocab.update({f"w{k}": k + len(specials) for k in range(WORDS)})
    model = WordLevel(vocab=vocab, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.pre_tokenizer = Split(" ", behavior="removed")  # "w1 w2</s>" keeps "</s>" apart below
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def word_text(gen: torch.Generator, num_words: int) -> str:
    """``num_words`` random words, space-separated (text the tiny tokenizer reads)."""
    return " ".join(f"w{int(k)}" for k in torch.randint(0, WORDS, (num_words,), generator=gen))
