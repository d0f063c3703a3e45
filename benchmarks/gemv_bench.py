"""Decode-sized linears on CPU: oneDNN's packed kernel vs ``cpu_gemv`` (the weight as stored).

For each weight shape of a model (``--size 31m`` or ``200m``, the Llamas of
``serve_vs_vllm.py``) and each row count, times the product both ways in one process,
interleaved, and prints the median weight bytes read per second (a product of a few rows is
a stream over the weight; a plain ``sum`` over the same bytes is printed as the box's
reference). ``cpu_gemv.MAX_ROWS`` holds the row counts, by dtype, up to which the kernel won here.
Enough copies of each weight are cycled (~200 MB) that every product reads from DRAM.

    .venv/bin/python benchmarks/gemv_bench.py --size 200m --rows 1,2,3,4,8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench_common import machine_description  # noqa: E402

from shardspeed.inference.fastgen.cpu_prepack import FP32_PACK_ROWS  # noqa: E402
from shardspeed.ops import cpu_gemv  # noqa: E402

# name: (hidden, intermediate, heads, kv heads, vocab), as in serve_vs_vllm.SIZES
MODELS = {"31m": (384, 1024, 8, 2, 32000), "200m": (1024, 2816, 16, 4, 32000)}


def shapes(size: str) -> dict[str, tuple[int, int]]:
    """The model's linear weights as FastGen fuses them: name -> (N, K)."""
    hidden, inter, heads, kv_heads, vocab = MODELS[size]
    head_dim = hidden // heads
    return {
        "qkv": (hidden + 2 * kv_heads * head_dim, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "head": (vocab, hidden),
    }


def _time_once(fn: Callable[[], object], nbytes: int, times: list[float]) -> None:
    start = time.perf_counter()
    fn()
    times.append(nbytes / (time.perf_counter() - start) / 1e9)


def bench_shape(
    n: int, k: int, dtype: torch.dtype, rows: list[int], rounds: int, cycle_bytes: float = 200e6
) -> dict[int, dict[str, float]]:
    """Median GB/s per row count of ``sum``, oneDNN and (up to 4 rows) ``cpu_gemv``."""
    copies = max(1, int(cycle_bytes // (n * k * torch.finfo(dtype).bits // 8)))
    weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
    hint = FP32_PACK_ROWS if dtype == torch.float32 else 1
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out = {}
    for m in rows:
        x = torch.randn(m, k).to(dtype)
        fns = {
            "sum": lambda: [w.sum() for w in weights],
            "onednn": lambda x=x: [
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed
            ],
        }
        if m <= cpu_gemv.KERNEL_MAX_ROWS:
            fns["gemv"] = lambda x=x: [cpu_gemv.linear(x, w, None) for w in weights]
        times: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():
            fn()
        for _ in range(rounds):
            for name, fn in fns.items():
                _time_once(fn, nbytes, times[name])
        out[m] = {name: statistics.median(v) for name, v in times.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", choices=sorted(MODELS), default="200m")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--rows", default="1,2,3,4,8")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    rows = [int(r) for r in args.rows.split(",")]
    available = cpu_gemv.kernel_dtypes()
    print(f"CPU: {machine_description()}; threads {args.threads}; model {args.size}; "
          f"cpu_gemv.MAX_ROWS {({str(d): r for d, r in cpu_gemv.MAX_ROWS.items()})}")  # fmt: skip
    print("| dtype | weight (N x K) | rows | sum GB/s | oneDNN GB/s | gemv GB/s | gemv / oneDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.dtypes.split(","):
        dtype = dtypes[name]
        if dtype not in available:
            print(f"| {name} | (no cpu_gemv kernel for {name} on this CPU) | | | | | |")
            continue
        for weight, (n, k) in shapes(args.size).items():
            for m, res in bench_shape(n, k, dtype, rows, args.rounds).items():
                gemv = res.get("gemv")
                cells = f"{gemv:.1f} | {gemv / res['onednn']:.2f}x" if gemv else "- | -"
                print(f"| {name} | {weight} {n} x {k} | {m} | {res['sum']:.1f} | "
                      f"{res['onednn']:.1f} | {cells} |")  # fmt: skip


if __name__ == "__main__":
    main()
