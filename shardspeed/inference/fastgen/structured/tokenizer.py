"""The engine's tokenizer as llguidance sees it: the bytes of every token id.

Two kinds are supported: Hugging Face *fast* tokenizers (their Rust ``tokenizers``
JSON is handed over as is) and shardspeed's :class:`~shardspeed.models.tokenizer.ByteTokenizer`
(token id = byte value). llguidance needs an end-of-sequence id to tell where a finished
grammar may stop; a tokenizer without one gets a virtual id past its own ids (masked,
never sampled): the engine ends a request as soon as its grammar can take no other token.
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import copy
from typing import Any

VIRTUAL_EOS = "<|shardspeed_structured_eos|>"


def require_llguidance() -> Any:
    """The ``llguidance`` module, or an ``ImportError`` saying how to install it."""
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise ImportError(
            "structured output (response_format / guided_json / guided_regex / guided_grammar) "
            "needs the llguidance package; install it with `pip install llguidance`."
        ) from exc
    return llguidance


class _ByteTokens:
    """The ``TokenizerWrapper`` protocol of llguidance for a 256-byte vocabulary plus a
    virtual end-of-sequence id 256."""

    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [VIRTUAL_EOS.encode()]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def build_ll_tokenizer(
    tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
) -> tuple[Any, int | None]:
    """An ``llguidance.LLTokenizer`` for ``tokenizer`` over a model of ``vocab_size`` ids,
    and the virtual end-of-sequence id it was given (None when a real one exists).

    ``eos_token_ids``: the ids that end generation in the engine (model and tokenizer
    EOS); empty means none exists and a virtual one is added (the caller masks it).
    """
    llg = require_llguidance()
    from shardspeed.models.tokenizer import ByteTokenizer

    if tokenizer is None:
        raise ValueError(
            "structured output needs the engine's tokenizer (token ids -> bytes) but the engine "
            "has none; build it with tokenizer=... (a Hugging Face fast tokenizer)."
        )
    if isinstance(tokenizer, ByteTokenizer):
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens())), _ByteTokens.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"structured output supports Hugging Face fast tokenizers and ByteTokenizer, not "
            f"{type(tokenizer).__name__}; load the model's tokenizer with "
            "AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos: list[int] = [int(t) for t in eos_token_ids]
    virtual = None
    if not eos:  # no EOS id at all: a virtual one past every real id
        backend.add_special_tokens([VIRTUAL_EOS])
        virtual = int(backend.token_to_id(VIRTUAL_EOS))
        eos = [virtual]
    n_vocab = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    return llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos), virtual
