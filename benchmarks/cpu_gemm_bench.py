"""fp32 products of 8-512 rows: oneDNN's packed kernel against shardspeed's AVX2 GEMM.

For each weight shape of a model (``--size 31m`` or ``200m``, the Llamas of
``serve_vs_vllm.py``) and each row count, oneDNN's packed product (what FastGen used for fp32
before) and :mod:`shardspeed.ops.cpu_gemm` (what it uses on CPUs with AVX2 and no AVX-512)
are checked against float64 and timed in one process, interleaved, on weights cold in cache
as in a serving step (each call takes the next of enough copies to fill ``--pool`` bytes);
the table gives the median GFLOP/s of each and their ratio.

    .venv/bin/python benchmarks/cpu_gemm_bench.py --size 200m --rows 8,32,512 --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench_common import machine_description  # noqa: E402
from gemv_bench import MODELS, shapes  # noqa: E402

from shardspeed.ops import cpu_gemm  # noqa: E402


def check(n: int, k: int, m: int) -> float:
    """Worst error of the kernel against float64, over F.linear's worst (both on one input)."""
    w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    ref = x.double() @ w.double().T + b.double()
    ours = (cpu_gemm.linear(x, cpu_gemm.pack(w), n, b).double() - ref).abs().max().item()
    theirs = (torch.nn.functional.linear(x, w, b).double() - ref).abs().max().item()
    return ours / max(theirs, 1e-30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(MODELS), default="200m")
    p.add_argument("--rows", default="8,32,128,512")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pool", type=float, default=256e6, help="bytes of weight copies cycled")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_gemm.available():
        raise SystemExit("the kernel is for CPUs with AVX2 + FMA and no AVX-512: nothing to run")
    for n, k, m in [(37, 300, 13), (5632, 1024, 27), (100, 1000, 1)]:
        ratio = check(n, k, m)
        assert ratio < 4.0, f"{n} x {k} at {m} rows: error {ratio:.1f}x F.linear's"
    rows = [int(r) for r in args.rows.split(",")]
    print(f"CPU: {machine_description()}; threads {args.threads}; model {args.size}")
    print("| weight (N x K) | rows | oneDNN GFLOP/s | cpu_gemm GFLOP/s | cpu_gemm / oneDNN |")
    print("| --- | --- | --- | --- | --- |")
    for name, (n, k) in shapes(args.size).items():
        w = torch.randn(n, k) * 0.02
        copies = max(1, int(args.pool // (n * k * 4)))
        onednn = itertools.cycle(
            [torch.ops.mkldnn._reorder_linear_weight(w, 32) for _ in range(copies)]
        )
        ours = itertools.cycle([cpu_gemm.pack(w) for _ in range(copies)])
        for m in rows:
            x = torch.randn(m, k)
            fns = {
                "onednn": lambda x=x, ws=onednn: torch.ops.mkldnn._linear_pointwise(
                    x, next(ws), None, "none", [], ""
                ),
                "ours": lambda x=x, n=n, ws=ours: cpu_gemm.linear(x, next(ws), n, None),
            }
            times: dict[str, list[float]] = {f: [] for f in fns}
            reps = max(1, int(2e9 / (2 * m * n * k)))
            for _ in range(args.rounds):
                for f, fn in fns.items():
                    fn()
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    times[f].append((time.perf_counter() - start) / reps)
            gf = {f: 2 * m * n * k / statistics.median(v) / 1e9 for f, v in times.items()}
            print(f"| {name} {n} x {k} | {m} | {gf['onednn']:.0f} | {gf['ours']:.0f} | "
                  f"{gf['ours'] / gf['onednn']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
