"""Decode attention over FastGen's blocked KV cache: the ``torch`` backend (decodes grouped by
context length, one padded SDPA per group over gathered blocks) against the ``cpu`` backend
(the native kernel reading blocks in place), one layer, best-of timing.

    .venv/bin/python benchmarks/decode_attention_bench.py --threads 1

Prints a markdown table (ms per layer call and the speed-up) and the CPU model.

``--baseline-source OLD.cpp`` also times another version of the kernel on the same inputs
(e.g. ``git show REV:shardspeed/inference/fastgen/cpu_attention/paged_decode.cpp > old.cpp``)
and checks that both agree; ``--cpu-time`` times by the thread's CPU time instead of wall
time (with ``--threads 1`` that keeps a busy machine's preemptions out of the numbers).

    .venv/bin/python benchmarks/decode_attention_bench.py --threads 1 --cpu-time \
        --baseline-source old.cpp --heads 16 --kv-heads 4
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


def _best_ms(fn, repeats: int, inner: int = 5, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(inner):
            fn()
        best = min(best, (clock() - start) / inner)
    return best * 1e3


def _baseline_kernel(source: str):
    """``(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap) -> out``
    of another kernel source, built beside the current one."""
    from shardspeed.ops.cpu_adam.builder import load_extension

    return load_extension(Path(source).resolve(), "decode_bench_baseline", "the baseline kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--baseline-source", default=None, help="another paged_decode.cpp")
    parser.add_argument("--cpu-time", action="store_true", help="time by thread CPU time")
    args = parser.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    baseline = _baseline_kernel(args.baseline_source) if args.baseline_source else None
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    print(f"CPU: {machine_description()}, {args.threads} thread(s), torch {torch.__version__}")
    extra = " baseline ms | cpu vs baseline |" if baseline else ""
    print(f"| dtype | decodes, context lengths | torch ms | cpu ms | speed-up |{extra}")
    print("|---|---|---|---|---|" + ("---|---|" if baseline else ""))
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
                    lambda m=meta, q=q, c=cache: _torch_attention(q, c, 0, m), args.repeats,
                    clock=clock,
                )  # fmt: skip
            row = (
                f"| {str(dtype).removeprefix('torch.')} | {num}, {lo}-{hi} | {times['torch']:.2f} "
                f"| {times['cpu']:.2f} | {times['torch'] / times['cpu']:.1f}x |"
            )
            if baseline is not None:
                dec = meta.decodes
                call = (q, cache.k[0], cache.v[0], dec.block_table, dec.context_lens)
                scale = args.head_dim**-0.5
                ours = _torch_attention(q, cache, 0, meta)
                theirs = baseline.paged_decode(*call, scale, 0, 0.0)
                torch.testing.assert_close(theirs.float(), ours.float(), rtol=1e-2, atol=1e-2)
                times["baseline"] = _best_ms(
                    lambda c=call, s=scale: baseline.paged_decode(*c, s, 0, 0.0),
                    args.repeats,
                    clock=clock,
                )
                row += f" {times['baseline']:.2f} | {times['baseline'] / times['cpu']:.2f}x |"
            print(row)


if __name__ == "__main__":
    main()
