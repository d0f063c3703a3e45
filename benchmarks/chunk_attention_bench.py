"""Short chunks on the ``"cpu"`` attention backend: SDPA per chunk vs kernel rows per token.

A chunk of n tokens (a speculative verify of ``[last, d1..dk]``, a draft model's catch-up,
a short prompt tail) can be attended by the torch path (gather the sequence's blocks, one
causal SDPA) or by the native decode kernel with one row per token (token i over the first
``ctx - n + 1 + i`` keys). ``ragged.NATIVE_CHUNK_MAX_TOKENS`` picks the kernel up to a
length; this bench times both ways through ``paged_attention`` to justify that bound, and
prints the largest difference of the two outputs.

    .venv/bin/python benchmarks/chunk_attention_bench.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench_common import machine_description  # noqa: E402

from shardspeed.inference.fastgen import ragged  # noqa: E402
from shardspeed.inference.fastgen.attention import paged_attention  # noqa: E402
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from shardspeed.inference.fastgen.request import Request  # noqa: E402
from shardspeed.inference.fastgen.sampling_params import SamplingParams  # noqa: E402
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence  # noqa: E402


def _batch(num_seqs: int, n: int, ctx: int, block_size: int, per_seq_blocks: int) -> ScheduledBatch:
    """``num_seqs`` chunks of ``n`` tokens ending at context ``ctx``, each in its own blocks."""
    req = Request("0", [0], SamplingParams())
    seqs = []
    for s in range(num_seqs):
        blocks = list(range(s * per_seq_blocks, s * per_seq_blocks + -(-ctx // block_size)))
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(ctx - n, ctx)]
        seqs.append(ScheduledSequence(req, [0] * n, ctx - n, slots, blocks, True))
    return ScheduledBatch(sequences=seqs)


def _best_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--seqs", default="1,8")
    parser.add_argument("--contexts", default="64,256,512")
    parser.add_argument("--tokens", default="2,5,8,16,32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype, bs = getattr(torch, args.dtype), 16
    contexts = [int(c) for c in args.contexts.split(",")]
    per_seq = -(-max(contexts) // bs)
    num_seqs = [int(s) for s in args.seqs.split(",")]
    spec = KVCacheSpec(1, args.kv_heads, args.head_dim, bs, dtype)
    cache = KVCache(spec, per_seq * max(num_seqs), torch.device("cpu"))
    cache.k[0].normal_()
    cache.v[0].normal_()
    print(f"# {machine_description()}; {args.threads} thread(s), {args.dtype}, heads "
          f"{args.heads}/{args.kv_heads}, D {args.head_dim}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| chunks | context | tokens | SDPA us | kernel rows us | speed-up | max diff |")
    print("|---|---|---|---|---|---|---|")
    default = ragged.NATIVE_CHUNK_MAX_TOKENS
    try:
        for s in num_seqs:
            for ctx in contexts:
                for n in (int(t) for t in args.tokens.split(",")):
                    batch = _batch(s, n, ctx, bs, per_seq)
                    q = torch.randn(s * n, args.heads, args.head_dim, dtype=dtype)
                    k = torch.randn(s * n, args.kv_heads, args.head_dim, dtype=dtype)
                    v = torch.randn_like(k)
                    times, outs = [], []
                    for bound in (0, n):  # 0: every chunk through SDPA; n: kernel rows
                        ragged.NATIVE_CHUNK_MAX_TOKENS = bound
                        rb = ragged.build_ragged_batch(batch, bs, torch.device("cpu"), "cpu")

                        def call(rb=rb, q=q, k=k, v=v):
                            return paged_attention(q, k, v, cache, 0, rb.slot_mapping, rb.attn)

                        times.append(_best_us(call, args.repeats))
                        outs.append(call().float())
                    diff = (outs[0] - outs[1]).abs().max().item()
                    print(f"| {s} | {ctx} | {n} | {times[0]:.0f} | {times[1]:.0f} | "
                          f"{times[0] / times[1]:.2f}x | {diff:.1e} |")  # fmt: skip
    finally:
        ragged.NATIVE_CHUNK_MAX_TOKENS = default


if __name__ == "__main__":
    main()
