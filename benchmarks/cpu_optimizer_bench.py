"""CPU Adam throughput: parameters updated per second, torch vs DeepSpeed vs shardspeed.

One flat fp32 parameter of 1M / 10M / 50M elements (what a ZeRO shard or a CPU-offloaded
master-weight partition is), a fixed gradient, AdamW with the same hyper-parameters in
every variant:

- ``torch-single`` / ``torch-foreach`` / ``torch-fused``: ``torch.optim.AdamW`` kernels;
- ``ds-cpuadam``: DeepSpeed 0.19.8 ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (a JIT-built C++
  op, AVX2/AVX-512; needs ``.venv-peers`` from ``make bench-peers``);
- ``ss-cpuadam``: ``shardspeed.ops.adam.DeepSpeedCPUAdam`` with its native kernel
  (``shardspeed/ops/cpu_adam/cpu_adam.cpp``, JIT-built once and cached; the run fails
  rather than silently timing the fallback);
- ``ss-torch-fused``: the same class forced onto torch's fused kernel
  (``SHARDSPEED_CPU_ADAM=torch``): its fallback, and the class's Python overhead on top of
  ``torch-fused``.

Every (variant, size, threads) runs in its own child process with the interpreter that has
the package. After the same number of steps from the same start every variant must hold the
same parameters; the table's ``max abs dp`` column is the largest difference from
``torch-single`` over a fixed slice (a check that the variants compute the same update).

``--paired`` answers "is A faster than B" more precisely than the table: per-process memory
placement moves a memory-bound row by +-5-10% on a shared VM, more than the kernels differ.
Each child then builds every ``--variants`` optimizer (own tensors), burns them in, and
alternates blocks of steps between them; the report is each variant's speed relative to the
first variant, as the geometric mean over ``--rounds`` children (variant order reversed in
every other child, which cancels allocation-order effects).

Usage:
    python benchmarks/cpu_optimizer_bench.py [--sizes 1M,10M,50M] [--threads 1] [--steps 10]
    python benchmarks/cpu_optimizer_bench.py --paired --variants ds-cpuadam,ss-cpuadam --rounds 6
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (  # noqa: E402
    child_env,
    default_python,
    emit_result,
    machine_description,
    peers_python,
    probe_python,
    ratio,
    render_table,
    run_child,
    summarize_times,
)

VARIANTS = (
    "torch-single",
    "torch-foreach",
    "torch-fused",
    "ds-cpuadam",
    "ss-cpuadam",
    "ss-torch-fused",
)
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
BYTES_PER_PARAM = 28  # fp32: read p, g, m, v (16 B) + write p, m, v (12 B)
FINGERPRINT = 2048  # elements of the final parameter sent back for the agreement check
DS_CPUADAM_PREWARM = (
    "import time; t = time.perf_counter(); "
    "from deepspeed.ops.op_builder.cpu import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False); "
    "print(f'{time.perf_counter() - t:.1f}')"
)
SS_CPUADAM_PREWARM = (
    "import os, time; os.environ['SHARDSPEED_CPU_ADAM'] = 'native'; "
    "os.environ['SHARDSPEED_LOG_LEVEL'] = 'WARNING'; t = time.perf_counter(); "
    "from shardspeed.ops.cpu_adam import select_backend; select_backend(); "
    "print(f'{time.perf_counter() - t:.1f}')"
)


def parse_size(text: str) -> int:
    """``'10M'`` -> 10_000_000; plain integers pass through."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def make_optimizer(variant: str, params: list[Any]) -> Any:
    """The optimizer of ``variant`` over ``params`` (raises ImportError when not installed)."""
    import torch

    kw = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
    if variant == "torch-single":
        return torch.optim.AdamW(params, foreach=False, fused=False, **kw)
    if variant == "torch-foreach":
        return torch.optim.AdamW(params, foreach=True, fused=False, **kw)
    if variant == "torch-fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    if variant == "ds-cpuadam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
    if variant in ("ss-cpuadam", "ss-torch-fused"):
        import os

        os.environ["SHARDSPEED_CPU_ADAM"] = "native" if variant == "ss-cpuadam" else "torch"
        from shardspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
        if opt.backend != os.environ["SHARDSPEED_CPU_ADAM"]:
            raise RuntimeError(f"{variant}: DeepSpeedCPUAdam chose backend {opt.backend!r}")
        return opt
    raise ValueError(f"variant={variant!r} is not known; use one of {', '.join(VARIANTS)}")


def burn_in(opt: Any, param: Any, seconds: float) -> int:
    """Step for ``seconds`` (untimed), then restore the start: same parameter, zero state.

    Step times on this shared VM fall by ~2x over the first ~20 in-cache steps (clock and
    scheduler ramp-up), which 2 warm-up steps do not cover; the restore keeps every variant
    on the same trajectory for the ``max abs dp`` check. Returns the number of steps.
    """
    import torch

    start_values = param.detach().clone()
    deadline, steps = time.perf_counter() + seconds, 0
    while time.perf_counter() < deadline:
        opt.step()
        steps += 1
    with torch.no_grad():
        param.copy_(start_values)
        for state in opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    value.zero_()
                else:
                    state[key] = type(value)(0)
    return steps


def paired_worker(args: argparse.Namespace) -> int:
    """Child of ``--paired``: alternate blocks of steps between the variants, one process."""
    import torch

    torch.set_num_threads(args.threads)
    variants = args.variant.split(",")
    opts = {}
    for variant in variants:
        gen = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(args.numel, generator=gen))
        param.grad = torch.randn(args.numel, generator=gen) * 1e-2
        opts[variant] = make_optimizer(variant, [param])
        burn_in(opts[variant], param, args.warmup_s)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.blocks):
        for variant, opt in opts.items():
            for i in range(args.warmup + args.steps):
                start = time.perf_counter()
                opt.step()
                if i >= args.warmup:  # the first steps of a block refill the caches
                    times[variant].append(time.perf_counter() - start)
    medians = {v: summarize_times(t)["median_ms"] for v, t in times.items()}
    emit_result(
        {"status": "ok", "numel": args.numel, "threads": args.threads, "median_ms": medians}
    )
    return 0


def run_paired(
    args: argparse.Namespace, variants: list[str], sizes: list[int], threads: list[int]
) -> int:
    """Parent of ``--paired``: speed of each variant relative to ``variants[0]``."""
    needs_peers = any(v.startswith("ds-") for v in variants)
    python = args.peers_python or (str(peers_python()) if needs_peers else None) or default_python()
    results = []
    for nthreads in threads:
        for numel in sizes:
            per_child: list[dict[str, float]] = []
            for r in range(max(args.rounds, 1)):
                order = variants if r % 2 == 0 else variants[::-1]
                cmd = [python, str(Path(__file__).resolve()), "--worker", "--paired"]
                cmd += [
                    "--variant",
                    ",".join(order),
                    "--numel",
                    str(numel),
                    "--threads",
                    str(nthreads),
                ]
                cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                cmd += ["--warmup-s", str(args.warmup_s), "--blocks", str(args.blocks)]
                _, found, tail = run_child(cmd, child_env(nthreads, "cpu"), args.timeout, None)
                if not found:
                    print(f"paired child failed ({numel:,} elements):\n{tail}")
                    return 1
                per_child.append(found[-1]["median_ms"])
            for v in variants:
                speed = [c[variants[0]] / c[v] for c in per_child]  # > 1: faster than variants[0]
                results.append(
                    {
                        "variant": v,
                        "reference": variants[0],
                        "numel": numel,
                        "threads": nthreads,
                        "median_ms": statistics.median(c[v] for c in per_child),
                        "speed_vs_ref": statistics.geometric_mean(speed),
                        "speed_min": min(speed),
                        "speed_max": max(speed),
                    }
                )
    print(f"date {_dt.date.today().isoformat()} | {machine_description()}")
    print(
        f"paired: {args.rounds} children per size, each {args.blocks} blocks x ({args.warmup} "
        f"untimed + {args.steps} timed) steps per variant after a {args.warmup_s:g} s burn-in; "
        f"speed = {variants[0]} step time / variant step time (geometric mean over children)"
    )
    print(paired_table(results, args.markdown))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"paired": True, "results": results}, indent=2))
        print(f"wrote {args.json_out}")
    return 0


def paired_table(results: list[dict[str, Any]], markdown: bool) -> str:
    """The ``--paired`` table: median step time and speed relative to the reference."""
    ref = results[0]["reference"] if results else "-"
    headers = ["variant", "numel", "threads", "median ms", f"speed vs {ref}", "min-max"]
    rows = [
        [r["variant"], f"{r['numel']:,}", r["threads"], r["median_ms"], f"{r['speed_vs_ref']:.3f}",
         f"{r['speed_min']:.3f}-{r['speed_max']:.3f}"]
        for r in results
    ]  # fmt: skip
    return render_table(headers, rows, markdown)


def worker(args: argparse.Namespace) -> int:
    """Child: time ``steps`` optimizer steps after ``warmup`` and print one result line."""
    import torch

    torch.set_num_threads(args.threads)
    base = {"variant": args.variant, "numel": args.numel, "threads": args.threads}
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(args.numel, generator=gen))
    param.grad = torch.randn(args.numel, generator=gen) * 1e-2
    t0 = time.perf_counter()
    try:
        opt = make_optimizer(args.variant, [param])
    except (ImportError, AttributeError) as exc:
        emit_result({**base, "status": "unavailable", "error": f"{type(exc).__name__}: {exc}"})
        return 0
    construct_s = time.perf_counter() - t0
    warm_steps = burn_in(opt, param, args.warmup_s)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    stats = summarize_times(times)
    emit_result(
        {
            **base,
            "status": "ok",
            "torch": torch.__version__,
            "optimizer_class": f"{type(opt).__module__}.{type(opt).__name__}",
            "construct_s": construct_s,
            "burn_in_steps": warm_steps,
            **stats,
            "step_times_ms": [t * 1e3 for t in times],
            "params_per_s": args.numel / (stats["median_ms"] / 1e3),
            "gb_per_s": BYTES_PER_PARAM * args.numel / (stats["median_ms"] / 1e3) / 1e9,
            "fingerprint": param.detach()[:FINGERPRINT].tolist(),
            "param_sum": float(param.detach().double().sum()),
        }
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--sizes", default="1M,10M,50M", help="comma-separated element counts")
    p.add_argument("--threads", default="1", help="comma-separated thread counts")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the burn-in")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=0.5,
        help="burn-in seconds of untimed steps, after which parameter and state are reset",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole plan this many times, interleaved; step times are pooled",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="all --variants in each child, alternating blocks; speed relative to the first",
    )
    p.add_argument("--blocks", type=int, default=8, help="--paired: blocks per variant per child")
    p.add_argument("--python", default=None, help="interpreter for torch / shardspeed rows")
    p.add_argument("--peers-python", default=None, help="interpreter with deepspeed")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="re-print a --json-out file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.threads = int(args.threads)
    return args


def _max_fingerprint_diff(a: dict[str, Any], b: dict[str, Any] | None) -> float | None:
    if b is None or "fingerprint" not in a or "fingerprint" not in b:
        return None
    return max(abs(x - y) for x, y in zip(a["fingerprint"], b["fingerprint"]))


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the step times of every successful round of one (variant, size, threads)."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) <= 1:
        return ok[0] if ok else runs[-1]
    merged = dict(ok[0])
    times_ms = [t for r in ok for t in r["step_times_ms"]]
    merged.update(summarize_times([t / 1e3 for t in times_ms]))
    merged["step_times_ms"] = times_ms
    merged["rounds"] = len(ok)
    seconds = merged["median_ms"] / 1e3
    merged["params_per_s"] = merged["numel"] / seconds
    merged["gb_per_s"] = BYTES_PER_PARAM * merged["numel"] / seconds / 1e9
    return merged


def report(results: list[dict[str, Any]], markdown: bool) -> str:
    """Results table with speed-ups against torch's single-tensor and fused kernels."""
    ok = {(r["variant"], r["numel"], r["threads"]): r for r in results if r["status"] == "ok"}
    headers = ["variant", "numel", "threads", "median ms", "p90 ms", "Mparam/s", "GB/s"]
    headers += ["x single", "x fused", "max abs dp"]
    rows = []
    for r in results:
        key = (r["numel"], r["threads"])
        if r["status"] != "ok":
            rows.append([r["variant"], r["numel"], r["threads"], r["status"], *["-"] * 6])
            continue
        single = ok.get(("torch-single", *key))
        fused = ok.get(("torch-fused", *key))
        rows.append(
            [
                r["variant"],
                f"{r['numel']:,}",
                r["threads"],
                r["median_ms"],
                r["p90_ms"],
                r["params_per_s"] / 1e6,
                r["gb_per_s"],
                ratio(r["params_per_s"], single["params_per_s"]) if single else None,
                ratio(r["params_per_s"], fused["params_per_s"]) if fused else None,
                _sci(r.get("max_abs_diff_vs_single")),
            ]
        )
    return render_table(headers, rows, markdown)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return paired_worker(args) if args.paired else worker(args)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        if saved.get("paired"):
            print(paired_table(saved["results"], args.markdown))
            return 0
        print(report(saved["results"], args.markdown))
        print("\n".join(saved["notes"]))
        return 0
    from tqdm import tqdm

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    if args.paired:
        return run_paired(args, variants, sizes, threads)
    torch_python = args.python or default_python()
    peers = args.peers_python or (str(peers_python()) if peers_python() else None)

    notes: list[str] = []
    if "ds-cpuadam" in variants:
        if peers is None:
            notes.append("ds-cpuadam: .venv-peers missing (run `make bench-peers`)")
        else:
            print("building/loading DeepSpeed's cpu_adam op (JIT, cached after the first time) ...")
            ok, line = probe_python(peers, DS_CPUADAM_PREWARM, timeout=args.timeout)
            notes.append(f"ds-cpuadam JIT build/load: {line + ' s' if ok else 'FAILED: ' + line}")
            print("  " + notes[-1])
    if "ss-cpuadam" in variants:
        print("building/loading shardspeed's native CPU Adam kernel (JIT, cached) ...")
        ok, line = probe_python(torch_python, SS_CPUADAM_PREWARM, timeout=args.timeout)
        notes.append(f"ss-cpuadam JIT build/load: {line + ' s' if ok else 'FAILED: ' + line}")
        print("  " + notes[-1])

    plan = [(v, n, t) for t in threads for n in sizes for v in variants]
    runs: dict[tuple[str, int, int], list[dict[str, Any]]] = {key: [] for key in plan}
    launches = [key for _ in range(max(args.rounds, 1)) for key in plan]
    for variant, numel, nthreads in tqdm(launches, desc="cpu_optimizer_bench", file=sys.stderr):
        python = peers if variant == "ds-cpuadam" else torch_python
        base = {"variant": variant, "numel": numel, "threads": nthreads}
        out = runs[(variant, numel, nthreads)]
        if python is None:
            out.append({**base, "status": "unavailable"})
            continue
        cmd = [python, str(Path(__file__).resolve()), "--worker", "--variant", variant]
        cmd += ["--numel", str(numel), "--threads", str(nthreads)]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--warmup-s", str(args.warmup_s)]
        code, found, tail = run_child(cmd, child_env(nthreads, "cpu"), args.timeout, None)
        out.append(found[-1] if found else {**base, "status": "error", "error": tail})
    results = [merge_rounds(runs[key]) for key in plan]
    ok = {(r["variant"], r["numel"], r["threads"]): r for r in results if r["status"] == "ok"}
    for r in ok.values():
        r["max_abs_diff_vs_single"] = _max_fingerprint_diff(
            r, ok.get(("torch-single", r["numel"], r["threads"]))
        )

    print()
    print(f"date {_dt.date.today().isoformat()} | {machine_description()}")
    print(
        f"AdamW fp32, lr={LR} betas={BETAS} eps={EPS} weight_decay={WEIGHT_DECAY} | "
        f"{args.warmup_s:g} s burn-in (then reset) + {args.warmup} warm-up + {args.steps} timed "
        f"steps x {args.rounds} rounds | GB/s assumes "
        f"{BYTES_PER_PARAM} B/param moved"
    )
    print(report(results, args.markdown))
    for note in notes:
        print(note)
    for r in results:
        if r["status"] == "unavailable" and r.get("error"):
            print(f"{r['variant']} unavailable: {r['error']}")
        elif r["status"] == "error":
            print(f"{r['variant']} {r['numel']} FAILED:\n{r.get('error', '')}")
    if args.json_out is not None:
        drop = ("fingerprint", "step_times_ms")
        slim = [{k: v for k, v in r.items() if k not in drop} for r in results]
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"notes": notes, "results": slim}, indent=2))
        print(f"wrote {args.json_out}")
    return 0 if all(r["status"] != "error" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
