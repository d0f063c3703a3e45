"""Incremental detokenization (fastgen/detokenizer.py): after every token the text equals
the full decode of the output so far (or, while a character's bytes are split across
tokens, its prefix before the replacement character), the final text equals the full
decode, and the work per token stays bounded. Tokenizers are built in memory (no hub):
byte-level BPE (GPT-2 style), a Llama-style Metaspace BPE with byte fallback and a
leading-space strip, WordPiece with cleanup of spaces before punctuation, and the library's
byte tokenizer."""

from __future__ import annotations

import random
from typing import Any

import pytest

from shardspeed.inference.fastgen import detokenizer
from shardspeed.inference.fastgen.detokenizer import DetokenizerState, decode
from shardspeed.models.tokenizer import ByteTokenizer

TEXT = [
    "Hello, world. The café's crème brûlée costs 5€ (or ¥700) — naïve? Yes!",
    "def f(x):\n    return {'a': [1, 2.5, None]}  # 日本語のテキスト 🙂🚀",
    "Ünïcödé  double  spaces , odd . punctuation ' quotes \" and tabs\there.",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "naïve", "café", "日本", "🙂", "x=1;", "end."]
    return TEXT + [" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)]


def _byte_level_bpe() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


def _llama_style() -> Any:
    """Metaspace pre-tokenizer, BPE with byte fallback (<0xNN> tokens), and Llama's decoder
    chain: replace the marker, fuse bytes, strip one leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])  # fmt: skip
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
        show_progress=False, limit_alphabet=60,
    )  # fmt: skip
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _wordpiece() -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=True)
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]", "[SEP]"], show_progress=False
    )
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )  # fmt: skip


TOKENIZERS = {
    "byte_level_bpe": _byte_level_bpe,
    "llama_style": _llama_style,
    "wordpiece": _wordpiece,
    "bytes": ByteTokenizer,
}


def _sequences(tok: Any) -> list[list[int]]:
    """Encoded texts (multi-byte characters across tokens) and random ids (specials,
    orphan bytes, punctuation after spaces)."""
    rng = random.Random(1)
    vocab = len(tok) if hasattr(tok, "__len__") else tok.vocab_size
    seqs = [list(tok.encode(t)) for t in TEXT]
    seqs += [[rng.randrange(vocab) for _ in range(rng.randint(1, 120))] for _ in range(30)]
    return seqs


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_text_after_every_token_is_the_full_decode(name: str) -> None:
    tok = TOKENIZERS[name]()
    for ids in _sequences(tok):
        state, text = DetokenizerState(), ""
        for n in range(1, len(ids) + 1):
            text = detokenizer.update(tok, ids[:n], text, state)
            full = decode(tok, ids[:n])
            if text != full:  # held back: a character still split across tokens
                assert full.startswith(text) and full.endswith("\ufffd"), (name, n)
                assert "\ufffd" in full[len(text) :]
        final = detokenizer.flush(tok, ids, text, state)
        assert final == decode(tok, ids), name


def test_work_per_token_stays_bounded() -> None:
    """Over 600 tokens the decode calls see a bounded window, not the whole output."""
    tok = _byte_level_bpe()
    seen: list[int] = []
    inner = tok.decode

    class Counting:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            seen.append(len(ids))
            return inner(ids, **kwargs)

    ids = [i for _ in range(40) for i in tok.encode(TEXT[0] + " ")][:600]
    state, text = DetokenizerState(), ""
    for n in range(1, len(ids) + 1):
        text = detokenizer.update(Counting(), ids[:n], text, state)
    assert detokenizer.flush(tok, ids, text, state) == decode(tok, ids)
    assert max(seen) <= 32, max(seen)  # a window, plus any characters held back
    assert sum(seen) <= 12 * len(ids), sum(seen)  # the full decode would be ~n^2 / 2


def test_engine_text_matches_the_full_decode_with_stop_strings() -> None:
    """Through the output processor: the finished text equals the full decode, and a stop
    string is still found and trimmed."""
    from shardspeed.inference.fastgen.output_processor import OutputProcessor
    from shardspeed.inference.fastgen.request import Request
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    tok = _llama_style()
    ids = list(tok.encode(TEXT[0]))
    proc = OutputProcessor(tok, eos_token_ids=[2], max_seq_len=4096)
    req = Request("a", [5, 6], SamplingParams(max_new_tokens=len(ids)))
    reasons = [proc.append(req, t, 0.0) for t in ids]
    assert reasons[-1] == "length" and req.text == decode(tok, ids)
    stop = SamplingParams(max_new_tokens=len(ids), stop=["brûlée"])
    req = Request("b", [5, 6], stop)
    for t in ids:
        if proc.append(req, t, 0.0):
            break
    assert req.finish_reason is None and req.text == decode(tok, ids).split("brûlée")[0]
