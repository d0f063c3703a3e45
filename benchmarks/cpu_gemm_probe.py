"""fp32 products of 8-512 rows: oneDNN's packed kernel against a register-blocked AVX2 GEMM.

A probe for issue 30's 200M fp32 offline row (compute-bound in oneDNN's products on a 2-core
AVX2 EPYC): ``cpu_gemm_probe.cpp`` (JIT-built beside the library's kernels, not part of the
library) packs each weight once and multiplies in 6 x 16 register blocks. For each weight
shape of a model (``--size 31m`` or ``200m``, the Llamas of ``serve_vs_vllm.py``) and each
row count, both products are checked against a float64 reference and timed in one process,
interleaved; the table gives the median GFLOP/s of each and their ratio.

    .venv/bin/python benchmarks/cpu_gemm_probe.py --size 200m --rows 8,32,128,512 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench_common import machine_description  # noqa: E402
from gemv_bench import MODELS, shapes  # noqa: E402

from shardspeed.ops.cpu_adam.builder import load_extension  # noqa: E402

SOURCE = Path(__file__).with_name("cpu_gemm_probe.cpp")


def check(module, n: int, k: int, m: int) -> float:
    """Worst error of the probe against float64, over F.linear's worst (both on one input)."""
    w, x, b = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    ref = x.double() @ w.double().T + b.double()
    ours = (module.linear(x, module.pack(w), n, b).double() - ref).abs().max().item()
    theirs = (torch.nn.functional.linear(x, w, b).double() - ref).abs().max().item()
    return ours / max(theirs, 1e-30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(MODELS), default="200m")
    p.add_argument("--rows", default="8,32,128,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    module = load_extension(SOURCE, "shardspeed_cpu_gemm_probe", "the AVX2 GEMM probe")
    if not module.available():
        raise SystemExit("this CPU has no AVX2 + FMA: the probe has nothing to run")
    for n, k, m in [(37, 300, 13), (5632, 1024, 27), (100, 1000, 1)]:
        ratio = check(module, n, k, m)
        assert ratio < 4.0, f"{n} x {k} at {m} rows: error {ratio:.1f}x F.linear's"
    rows = [int(r) for r in args.rows.split(",")]
    print(f"CPU: {machine_description()}; threads {args.threads}; model {args.size}")
    print("| weight (N x K) | rows | oneDNN GFLOP/s | probe GFLOP/s | probe / oneDNN |")
    print("| --- | --- | --- | --- | --- |")
    for name, (n, k) in shapes(args.size).items():
        w = torch.randn(n, k) * 0.02
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        probe = module.pack(w)
        for m in rows:
            x = torch.randn(m, k)
            fns = {
                "onednn": lambda x=x, w=onednn: torch.ops.mkldnn._linear_pointwise(
                    x, w, None, "none", [], ""
                ),
                "probe": lambda x=x, w=probe, n=n: module.linear(x, w, n, None),
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
            print(f"| {name} {n} x {k} | {m} | {gf['onednn']:.0f} | {gf['probe']:.0f} | "
                  f"{gf['probe'] / gf['onednn']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
