"""Byte-level tokenizer: token id = byte value (vocabulary 256), lossless for any text."""

from __future__ import annotations


class ByteTokenizer:
    """Encodes text as UTF-8 bytes. No special tokens; ``eos_token_id`` is None."""

    vocab_size = 256
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")
