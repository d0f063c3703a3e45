"""benchmarks/detokenize_bench.py: one tiny pass of both measurements (the engine rounds
assert that both detokenizers give the full decode's text)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import detokenize_bench  # noqa: E402

from shardspeed.inference.fastgen import detokenizer  # noqa: E402


def test_tiny_pass_times_both_detokenizers_and_restores_the_engine_rule() -> None:
    tok = detokenize_bench.bpe_tokenizer(400)
    per_token = detokenize_bench.per_token_us(tok, 80, rounds=1)
    assert set(per_token) == {"full", "incremental"} and min(per_token.values()) > 0
    args = argparse.Namespace(hidden=64, layers=1, batch=2, new_tokens=12, rounds=1)
    res = detokenize_bench.engine_rounds(tok, args)
    assert {k: len(v) for k, v in res.items()} == {"full": 1, "incremental": 1}
    assert detokenizer.update.__module__ == detokenizer.__name__  # not left patched
