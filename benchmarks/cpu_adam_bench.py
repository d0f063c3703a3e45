"""Time one CPU AdamW step on a flat fp32 tensor: single-tensor vs foreach vs fused kernels.

ShardSpeed's optimizer factory picks its CPU default from these numbers (ZeRO shards and
CPU-offloaded master weights are one large flat tensor per rank).

Usage:
    python benchmarks/cpu_adam_bench.py [--numel 10000000] [--steps 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardspeed.optim.lion import Lion

KERNELS: dict[str, dict[str, bool]] = {
    "single-tensor": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"fused": True},
}


def time_steps(make_opt, param: torch.Tensor, steps: int, warmup: int = 3) -> list[float]:
    """Per-step wall times (seconds) of ``make_opt([param]).step()`` after ``warmup`` steps."""
    opt = make_opt([param])
    param.grad = torch.randn_like(param)
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    param = torch.randn(args.numel, dtype=torch.float32)
    gb = args.numel * 4 / 1e9

    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"flat fp32 tensor of {args.numel:,} elements, {args.steps} timed steps"
    )
    print(f"{'optimizer':<10} {'kernel':<14} {'median ms':>10} {'min ms':>8} {'GB/s (param)':>12}")
    results: dict[tuple[str, str], float] = {}
    cases = [("AdamW", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01))]
    cases.append(("Adam", torch.optim.Adam, dict(lr=1e-3, weight_decay=0.0)))
    cases.append(("Adagrad", torch.optim.Adagrad, dict(lr=1e-2)))
    cases.append(("SGD-mom", torch.optim.SGD, dict(lr=1e-2, momentum=0.9)))
    for name, cls, kw in cases:
        for kernel, flags in KERNELS.items():
            p = param.clone()
            try:
                times = time_steps(lambda ps, c=cls, k=kw, f=flags: c(ps, **k, **f), p, args.steps)
            except (RuntimeError, ValueError) as err:
                print(f"{name:<10} {kernel:<14} unsupported: {str(err).splitlines()[0][:60]}")
                continue
            med = statistics.median(times)
            results[(name, kernel)] = med
            print(
                f"{name:<10} {kernel:<14} {med * 1e3:>10.1f} {min(times) * 1e3:>8.1f} "
                f"{gb / med:>12.2f}"
            )
    for kernel, flags in (("single-tensor", {"foreach": False}), ("foreach", {"foreach": True})):
        p = param.clone()
        times = time_steps(
            lambda ps, f=flags: Lion(ps, lr=1e-4, weight_decay=0.01, **f), p, args.steps
        )
        med = statistics.median(times)
        print(
            f"{'Lion':<10} {kernel:<14} {med * 1e3:>10.1f} {min(times) * 1e3:>8.1f} "
            f"{gb / med:>12.2f}"
        )
    for name in ("AdamW", "Adam"):
        timed = {k: v for (n, k), v in results.items() if n == name}
        if timed:
            best = min(timed, key=timed.__getitem__)
            print(f"fastest {name} kernel: {best}")


if __name__ == "__main__":
    main()
