"""FastGen detokenization: incremental (a short window per token) against decoding the whole
output after every token, the way the engine did before ``fastgen/detokenizer.py``.

Two measurements, one process, interleaved rounds:

1. per token: microseconds to extend one request's text by one token, at output lengths of
   128 / 512 / 2048 tokens (a byte-level BPE tokenizer trained in memory on this file's
   corpus, so no hub access);
2. the engine: a random Llama over that tokenizer generating ``--new-tokens`` tokens for
   ``--batch`` requests (offline ``generate``), tokens/s with each detokenizer.

    .venv/bin/python benchmarks/detokenize_bench.py --batch 32 --new-tokens 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench_common import machine_description  # noqa: E402
from spec_trained import train_tokenizer  # noqa: E402

from shardspeed.inference.fastgen import detokenizer  # noqa: E402
from shardspeed.inference.fastgen.detokenizer import DetokenizerState, decode  # noqa: E402


def bpe_tokenizer(vocab_size: int) -> Any:
    """A GPT-2-style byte-level BPE trained on this repository's Python sources."""
    root = Path(__file__).resolve().parent.parent / "shardspeed"
    return train_tokenizer(sorted(root.rglob("*.py"))[:400], vocab_size)


def full_update(tokenizer: Any, ids: list[int], text: str, state: DetokenizerState) -> str:
    """The previous engine's rule: decode the whole output again."""
    return decode(tokenizer, ids)


def full_flush(tokenizer: Any, ids: list[int], text: str, state: DetokenizerState) -> str:
    return decode(tokenizer, ids)


def per_token_us(tokenizer: Any, length: int, rounds: int) -> dict[str, float]:
    """Median microseconds per appended token over the last 64 tokens of ``length``."""
    rng = random.Random(length)
    ids = [rng.randrange(1, len(tokenizer)) for _ in range(length)]
    out: dict[str, list[float]] = {"full": [], "incremental": []}
    for _ in range(rounds):
        for name, fn in (("full", full_update), ("incremental", detokenizer.update)):
            state, text = DetokenizerState(), ""
            for n in range(1, length - 63):  # build up the state untimed
                text = fn(tokenizer, ids[:n], text, state)
            start = time.perf_counter()
            for n in range(length - 63, length + 1):
                text = fn(tokenizer, ids[:n], text, state)
            out[name].append((time.perf_counter() - start) / 64 * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def engine_rounds(tokenizer: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardspeed.inference.fastgen.engine import EngineConfig, InferenceEngine
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=4096,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    max_len = 16 + args.new_tokens + 16
    engine = InferenceEngine(model, tokenizer=tokenizer, config=EngineConfig(
        max_seq_len=max_len, max_ragged_sequence_count=args.batch,
        max_ragged_batch_size=max(512, args.batch), block_size=16,
        num_blocks=args.batch * (max_len // 16 + 1) + 8,
    ))  # fmt: skip
    rng = random.Random(0)
    prompts = [[rng.randrange(1, len(tokenizer)) for _ in range(16)] for _ in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0.0)
    variants = {
        "full": (full_update, full_flush),
        "incremental": (detokenizer.update, detokenizer.flush),
    }
    out: dict[str, list[float]] = {k: [] for k in variants}
    saved = (detokenizer.update, detokenizer.flush)
    try:
        for _ in range(args.rounds):
            for name, (update, flush) in variants.items():
                detokenizer.update, detokenizer.flush = update, flush  # type: ignore[assignment]
                start = time.perf_counter()
                results = engine.generate(prompts, params)
                elapsed = time.perf_counter() - start
                assert all(r.text == decode(tokenizer, r.output_token_ids) for r in results)
                out[name].append(args.batch * args.new_tokens / elapsed)
    finally:
        detokenizer.update, detokenizer.flush = saved  # type: ignore[assignment]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--lengths", default="128,512,2048")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = bpe_tokenizer(args.vocab)
    print(f"CPU: {machine_description()}; threads {args.threads}; tokenizer: byte-level BPE, "
          f"{len(tokenizer)} tokens")  # fmt: skip
    print("| output length | full decode us/token | incremental us/token | ratio |")
    print("| --- | --- | --- | --- |")
    for length in (int(x) for x in args.lengths.split(",")):
        r = per_token_us(tokenizer, length, args.rounds)
        print(f"| {length} | {r['full']:.1f} | {r['incremental']:.1f} | "
              f"{r['full'] / r['incremental']:.1f}x |")  # fmt: skip
    if args.skip_engine:
        return
    res = engine_rounds(tokenizer, args)
    full, inc = (statistics.median(res[k]) for k in ("full", "incremental"))
    print(f"\nengine: Llama hidden {args.hidden} x {args.layers} layers, batch {args.batch}, "
          f"{args.new_tokens} new tokens each")  # fmt: skip
    print("| detokenizer | tokens/s (rounds) |")
    print("| --- | --- |")
    for name, vals in res.items():
        print(
            f"| {name} | {statistics.median(vals):.0f} ({' / '.join(f'{v:.0f}' for v in vals)}) |"
        )
    print(f"incremental / full: {inc / full:.2f}x")


if __name__ == "__main__":
    main()
