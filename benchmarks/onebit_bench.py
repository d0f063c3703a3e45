"""1-bit optimizers vs Adam on CPU/gloo: bytes per step, step time, and convergence.

Part 1 (communication): a 4-layer GPT (n_embd 256, ~3.2M parameters) at ZeRO stage 0 on 2 and
4 gloo ranks. After the warm-up (``freeze_step`` / ``var_freeze_step`` = 2) every optimizer
runs ``--steps`` steps with the comms logger on (bytes of every collective a rank issued,
per step) and ``--steps`` more without it (step time, median over steps and ranks).

Part 2 (convergence): a 2-layer GPT (n_embd 64, block 64) on the stdlib-source corpus,
2 ranks, 300 steps of a global batch of 16 windows, the same batches for every optimizer.
The final loss is the mean training loss of the last 20 steps (every batch is new text, so
it is a held-out loss). LAMB is OneBitLamb with a freeze step past the end (uncompressed).
LAMB rows run at their own learning rates (``--lamb-lrs``): the trust ratio makes their
steps much smaller than Adam's at the same rate.

Usage::

    .venv/bin/python benchmarks/onebit_bench.py                 # both parts, markdown tables
    .venv/bin/python benchmarks/onebit_bench.py --part bytes --worlds 2
    .venv/bin/python benchmarks/onebit_bench.py --part convergence --conv-steps 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent))

from _bench_common import machine_description, render_table  # noqa: E402

# (label, ds_config optimizer type, params) of part 1: compression from step 3 on; 0/1 Adam
# synchronises every step, or (local steps) every 4th step once its interval has grown
COMM_ROWS = (
    ("Adam", "AdamW", {}),
    ("OneBitAdam", "OneBitAdam", {"freeze_step": 2}),
    ("ZeroOneAdam", "ZeroOneAdam", {"var_freeze_step": 2, "local_step_scaler": 1000}),
    (
        "ZeroOneAdam, local steps",
        "ZeroOneAdam",
        {"var_freeze_step": 2, "local_step_scaler": 1, "local_step_clipper": 4},
    ),
    ("OneBitLamb", "OneBitLamb", {"freeze_step": 2}),
)


def convergence_rows(
    steps: int, lr: float, lamb_lrs: list[float]
) -> list[tuple[str, str, dict[str, Any], float]]:
    """(label, type, params, lr): warm-up ~17% of the run, as DeepSpeed's tutorials suggest
    (15-25%). LAMB's trust ratio shrinks its steps, so it runs at its own learning rates."""
    freeze = max(1, steps // 6)
    rows = [
        ("Adam", "AdamW", {}, lr),
        ("OneBitAdam", "OneBitAdam", {"freeze_step": freeze}, lr),
        (
            "ZeroOneAdam",
            "ZeroOneAdam",
            {
                "var_freeze_step": freeze,
                "var_update_scaler": 8,
                "local_step_scaler": freeze,
                "local_step_clipper": 4,
            },
            lr,
        ),
    ]
    for lamb_lr in lamb_lrs:
        rows.append(("LAMB (uncompressed)", "OneBitLamb", {"freeze_step": 10**9}, lamb_lr))
        rows.append(("OneBitLamb", "OneBitLamb", {"freeze_step": freeze}, lamb_lr))
    return rows


def _wire_segments(engine: Any) -> None:
    """Parameter boundaries for OneBitLamb (until the engine passes them itself)."""
    from shardspeed.zero.fragments import param_fragments

    opt = engine.basic_optimizer
    if not hasattr(opt, "set_param_segments"):
        return
    segments = []
    for group in engine.flat_groups:
        per_master: list[list[tuple[int, int]]] = [[] for _ in group.masters]
        for f in param_fragments(group):
            per_master[f.master_index].append((f.local, f.length))
        segments.append(per_master)
    opt.set_param_segments(segments)


def _engine(model: Any, opt_type: str, params: dict[str, Any], lr: float, micro: int) -> Any:
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 50_000_000},
        "optimizer": {"type": opt_type, "params": {"lr": lr, **params}},
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    _wire_segments(engine)
    return engine


# -- part 1: bytes and time ------------------------------------------------------------------


def comm_rank(opt_type: str, params: dict[str, Any], steps: int) -> dict[str, Any]:
    import torch

    from shardspeed import comm
    from shardspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256, bias=False)
    )
    numel = sum(p.numel() for p in model.parameters())
    engine = _engine(model, opt_type, params, lr=1e-3, micro=4)
    g = torch.Generator().manual_seed(comm.get_rank())

    def one_step() -> None:
        tokens = torch.randint(0, 256, (4, 65), generator=g)
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()

    for _ in range(3):  # past the warm-up: every later step is a compression-stage step
        one_step()
    comm.configure(enabled=True, prof_all=True)
    comm.reset_log()
    for _ in range(steps):
        one_step()
    logged = comm.get_logged_comm_ops()
    comm.configure(enabled=False)
    comm.reset_log()
    times = []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    engine.destroy()
    return {
        "numel": numel,
        "bytes_per_step": sum(op["total_bytes"] for op in logged.values()) / steps,
        "ops": {name: op["count"] / steps for name, op in logged.items()},
        "step_ms": statistics.median(times) * 1e3,
    }


def run_comm(worlds: list[int], steps: int) -> str:
    import onebit_bench  # the ranks import this module by name

    from shardspeed.testing import run_distributed

    rows = []
    for world in worlds:
        adam_bytes = adam_ms = None
        for label, opt_type, params in COMM_ROWS:
            per_rank = run_distributed(
                onebit_bench.comm_rank, world, opt_type, params, steps, timeout=900
            )
            bytes_per_step = statistics.mean(r["bytes_per_step"] for r in per_rank)
            step_ms = statistics.median(r["step_ms"] for r in per_rank)
            if label == "Adam":
                adam_bytes, adam_ms = bytes_per_step, step_ms
            ops = ", ".join(f"{k} x{v:g}" for k, v in sorted(per_rank[0]["ops"].items()))
            rows.append(
                [
                    world,
                    label,
                    f"{bytes_per_step / 1e6:.3f}",
                    f"{adam_bytes / bytes_per_step:.1f}x" if bytes_per_step else "inf",
                    f"{step_ms:.0f}",
                    f"{step_ms / adam_ms:.2f}",
                    ops or "-",
                ]
            )
            print(f"[comm] world {world} {label}: {rows[-1]}", file=sys.stderr, flush=True)
    headers = ["ranks", "optimizer", "MB / step / rank", "fewer bytes than Adam",
               "step ms", "time vs Adam", "collectives per step"]  # fmt: skip
    return render_table(headers, rows, markdown=True)


# -- part 2: convergence ---------------------------------------------------------------------


def convergence_rank(opt_type: str, params: dict[str, Any], steps: int, lr: float) -> list[float]:
    import torch

    from shardspeed import comm
    from shardspeed.data.stdlib_corpus import load_stdlib_corpus
    from shardspeed.models import GPT, GPTConfig

    rank, world = comm.get_rank(), comm.get_world_size()
    micro, block = 8, 64
    tokens = load_stdlib_corpus(2_000_000).long()
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=256, block_size=block, n_layer=2, n_head=4, n_embd=64, bias=False)
    )
    engine = _engine(model, opt_type, params, lr=lr, micro=micro)
    g = torch.Generator().manual_seed(1234)  # the same global batches on every rank and run
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - block - 1, (world * micro,), generator=g)
        mine = starts[rank * micro : (rank + 1) * micro]
        batch = torch.stack([tokens[s : s + block + 1] for s in mine.tolist()])  # (micro, block+1)
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        total = loss.detach().double().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    engine.destroy()
    return losses


def run_convergence(steps: int, lr: float, lamb_lrs: list[float]) -> str:
    import onebit_bench

    from shardspeed.testing import run_distributed

    rows_spec = convergence_rows(steps, lr, lamb_lrs)
    results: list[list[float]] = []
    for label, opt_type, params, row_lr in rows_spec:
        results.append(
            run_distributed(
                onebit_bench.convergence_rank, 2, opt_type, params, steps, row_lr, timeout=900
            )[0]
        )
        print(f"[convergence] {label} lr {row_lr}: {results[-1][-1]:.4f}", file=sys.stderr)
    tail = min(20, steps)
    finals = [statistics.mean(losses[-tail:]) for losses in results]
    adam = finals[0]
    rows = []
    for i, ((label, _, params, row_lr), losses) in enumerate(zip(rows_spec, results)):
        # OneBitLamb rows follow their uncompressed LAMB row at the same learning rate
        vs_lamb = f"{100 * (finals[i] / finals[i - 1] - 1):+.2f}%" if label == "OneBitLamb" else ""
        marks = [losses[j - 1] for j in (1, steps // 4, steps // 2, steps) if j >= 1]
        rows.append(
            [
                label,
                f"{row_lr:g}",
                ", ".join(f"{k}={v}" for k, v in params.items()) or "-",
                " / ".join(f"{m:.3f}" for m in marks),
                f"{finals[i]:.4f}",
                f"{100 * (finals[i] / adam - 1):+.2f}%",
                vs_lamb,
            ]
        )
    headers = ["optimizer", "lr", "params", f"loss at 1 / {steps // 4} / {steps // 2} / {steps}",
               f"final (mean of last {tail})", "vs Adam", "vs LAMB, same lr"]  # fmt: skip
    return render_table(headers, rows, markdown=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "bytes", "convergence"), default="all")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per row (part 1)")
    parser.add_argument("--conv-steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam-family lr (part 2)")
    parser.add_argument("--lamb-lrs", type=float, nargs="+", default=[1e-2, 3e-2])
    args = parser.parse_args(argv)
    print(f"machine: {machine_description()}")
    if args.part in ("all", "bytes"):
        print(f"\n### Bytes and step time (measured over {args.steps} compression-stage steps)\n")
        print(run_comm(args.worlds, args.steps))
    if args.part in ("all", "convergence"):
        print(f"\n### Convergence, 2 ranks, {args.conv_steps} steps\n")
        print(run_convergence(args.conv_steps, args.lr, args.lamb_lrs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
