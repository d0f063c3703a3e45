"""Block-sparse attention vs dense ``scaled_dot_product_attention`` on CPU: time and memory.

For each sequence length, one child process times forward + backward of every method in
interleaved rounds (dense, Fixed, BigBird, dense, Fixed, ...) so that load from other
processes on a shared machine hits all methods alike; the table reports the median and the
minimum (the least disturbed round). Peak memory
is measured separately, one fresh child per (method, length):

    peak = VmHWM - VmRSS  around one forward + backward, after a warm-up pass,

with the high-water mark reset through ``/proc/self/clear_refs`` and glibc's mmap threshold
pinned (``MALLOC_MMAP_THRESHOLD_``) so freed tensors go back to the OS instead of inflating
the baseline. It counts everything allocated during the step: activations, workspace and the
q/k/v gradients (the same 3 x B*H*L*D for every method).

Usage::

    .venv/bin/python benchmarks/sparse_attention_bench.py                  # 1k..8k
    .venv/bin/python benchmarks/sparse_attention_bench.py --seqs 1024 16384 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from _bench_common import (  # noqa: E402
    child_env,
    emit_result,
    machine_description,
    render_table,
    run_child,
)

METHODS = ("dense", "fixed", "bigbird")


def sparsity_config(method: str, num_heads: int):
    from shardspeed.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig

    if method == "fixed":  # local windows of 16 x 32 = 512 tokens + one global block each
        return FixedSparsityConfig(num_heads, block=32, num_local_blocks=16, num_global_blocks=1)
    if method == "bigbird":  # the BigBird paper's ITC setting: blocks of 64, 3 random / 3 / 2
        return BigBirdSparsityConfig(
            num_heads,
            block=64,
            num_random_blocks=3,
            num_sliding_window_blocks=3,
            num_global_blocks=2,
            seed=0,
        )
    raise ValueError(f"unknown sparse method {method!r}")


def make_step(method: str, seq: int, args: argparse.Namespace):
    """(step running forward + backward, density of the attention matrix, (q, k, v)).

    The step drops the previous gradients first, so they are never alive twice.
    """
    import torch

    from shardspeed.ops.sparse_attention import block_sparse_attention, build_plan

    shape = (args.batch, args.heads, seq, args.head_dim)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    if method == "dense":
        attend = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
        density = 1.0
    else:
        plan = build_plan(sparsity_config(method, args.heads).make_layout(seq))
        attend = lambda: block_sparse_attention(q, k, v, plan)  # noqa: E731
        density = plan.density

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        attend().sum().backward()

    return step, density, (q, k, v)


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_time(args: argparse.Namespace) -> None:
    steps = {m: make_step(m, args.seq, args) for m in args.methods}
    for step, _, _ in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    for _ in range(args.rounds):
        for method, (step, _, _) in steps.items():
            start = time.perf_counter()
            step()
            times[method].append(time.perf_counter() - start)
    emit_result(
        {"seq": args.seq, "times": times, "density": {m: d for m, (_, d, _) in steps.items()}}
    )


def child_memory(args: argparse.Namespace) -> None:
    (method,) = args.methods
    step, _, inputs = make_step(method, args.seq, args)
    step()  # warm-up: thread pools, kernels
    for t in inputs:
        t.grad = None  # the gradients are part of what the step allocates
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _proc_status_kib("VmRSS")
    step()
    peak = _proc_status_kib("VmHWM")
    emit_result({"seq": args.seq, "method": method, "peak_mib": (peak - before) / 1024})


def run_parent(args: argparse.Namespace) -> None:
    import torch

    threads = args.threads or os.cpu_count() or 1
    env = child_env(threads=threads, device="cpu")
    mem_env = dict(env, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    common = [
        f"--batch={args.batch}",
        f"--heads={args.heads}",
        f"--head-dim={args.head_dim}",
        f"--rounds={args.rounds}",
    ]
    q = torch.randn(1, args.heads, 1024, args.head_dim, requires_grad=True)
    backend = torch._fused_sdp_choice(q, q, q)
    print(f"CPU: {machine_description()}; torch {torch.__version__}; {threads} threads")
    print(
        f"batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}, fp32, "
        f"{args.rounds} interleaved rounds; dense SDPA backend id {backend} (1 = flash)"
    )
    print(f"load average at start: {os.getloadavg()}")

    rows = []
    for seq in args.seqs:
        cmd = [sys.executable, __file__, "--child=time", f"--seq={seq}", *common]
        code, results, tail = run_child(cmd + ["--methods", *args.methods], env, 3600, None)
        if code != 0 or not results:
            print(f"seq {seq}: timing child failed ({code}):\n{tail}")
            continue
        timing = results[0]
        peaks = {}
        for method in args.methods:
            mcmd = [*cmd[:2], "--child=memory", f"--seq={seq}", *common, "--methods", method]
            code, results, tail = run_child(mcmd, mem_env, 3600, None)
            peaks[method] = results[0]["peak_mib"] if code == 0 and results else None
        dense = timing["times"]["dense"]
        for method in args.methods:
            times = timing["times"][method]
            peak = peaks[method]
            rows.append(
                [
                    seq,
                    method,
                    f"{timing['density'][method]:.3f}",
                    statistics.median(times) * 1e3,
                    min(times) * 1e3,
                    statistics.median(dense) / statistics.median(times),
                    min(dense) / min(times),
                    peak,
                    None if peak is None or not peaks["dense"] else peaks["dense"] / peak,
                ]
            )
        print(f"seq {seq} done; load average {os.getloadavg()}", flush=True)

    headers = [
        "seq",
        "method",
        "density",
        "fwd+bwd ms median",
        "ms min",
        "speed-up (median)",
        "speed-up (min)",
        "peak MiB",
        "dense/this memory",
    ]
    print()
    print(render_table(headers, rows, markdown=args.markdown))
    print(f"\nload average at end: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"headers": headers, "rows": rows}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="0: all cores")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", default="", help="also write the table to this file")
    parser.add_argument("--child", choices=["time", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "time":
        child_time(args)
    elif args.child == "memory":
        child_memory(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
