"""Decode attention over FastGen's blocked KV cache: the ``torch`` backend (decodes grouped by
context length, one padded SDPA per group over gathered blocks) against the ``cpu`` backend
(the native kernel reading blocks in place), one layer, best-of timing.

    .venv/bin/python benchmarks/decode_attention_bench.py --threads 1

Prints a markdown table (ms per layer call and the speed-up) and the CPU model.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from shardspeed.inference.fastgen.attention import _torch_attention
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.ragged import _torch_metadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine_description  # noqa: E402

CASES = [(8, 64, 256), (24, 30, 380), (64, 100, 1000)]  # (decodes, min ctx, max ctx)


def _best_ms(fn, repeats: int, inner: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    print(f"CPU: {machine_description()}, {args.threads} thread(s), torch {torch.__version__}")
    print("| dtype | decodes, context lengths | torch ms | cpu ms | speed-up |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        spec = KVCacheSpec(1, args.kv_heads, args.head_dim, args.block_size, dtype)
        cache = KVCache(spec, 4096, cpu)
        cache.k[0].normal_()
        cache.v[0].normal_()
        for num, lo, hi in CASES:
            rng = random.Random(0)
            seqs, used = [], 0
            for _ in range(num):
                ctx = rng.randint(lo, hi)
                blocks = -(-ctx // args.block_size)
                table = list(range(used, used + blocks))
                used += blocks
                seqs.append(
                    SimpleNamespace(
                        num_tokens=1, context_len=ctx, block_table=table, start_position=ctx - 1
                    )
                )
            batch = SimpleNamespace(sequences=seqs)
            q = torch.randn(num, args.heads, args.head_dim).to(dtype)
            times = {}
            for name, native in (("torch", False), ("cpu", True)):
                meta = _torch_metadata(batch, args.block_size, cpu, native_decodes=native)
                times[name] = _best_ms(
                    lambda m=meta, q=q, c=cache: _torch_attention(q, c, 0, m), args.repeats
                )
            print(
                f"| {str(dtype).removeprefix('torch.')} | {num}, {lo}-{hi} | {times['torch']:.2f} "
                f"| {times['cpu']:.2f} | {times['torch'] / times['cpu']:.1f}x |"
            )


if __name__ == "__main__":
    main()
