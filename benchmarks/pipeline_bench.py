"""Pipeline schedules: bubble (idle fraction) per stage, and step time next to DeepSpeed.

    .venv/bin/python benchmarks/pipeline_bench.py                # everything (CPU, gloo)
    .venv/bin/python benchmarks/pipeline_bench.py --no-deepspeed # ShardSpeed only

Three parts:

1. *Analytic*: the schedules on the simulator's virtual clock (``mode="async"``, the
   engine's semantics) with uniform stage cost, backward = 2 x forward.
2. *Measured bubble*: the real engine on ``p=4`` ranks where every stage costs the same:
   each layer *sleeps* a fixed time in forward and backward (a sleep does not use a CPU
   core, so four stages on a 2-core machine behave like four devices). Busy time per
   stage is the sum of its sleeps; idle fraction = 1 - busy / train_batch wall time,
   next to the ideal ``(p-1)/(m+p-1)`` (``(p-1)/(v*m+p-1)`` interleaved).
3. *Side by side*: ``train_batch`` time of ShardSpeed's and DeepSpeed's PipelineEngine,
   same model, same 1F1B schedule, CPU/gloo, each in its own torchrun launch (DeepSpeed
   runs from ``.venv-peers``): the sleep model (p=4) and a small real-compute MLP (p=2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 16
_BUSY = [0.0]  # seconds this process spent inside SleepLayer forward/backward


# ---------------------------------------------------------------------------- models
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        t0 = time.perf_counter()
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        _BUSY[0] += time.perf_counter() - t0
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        t0 = time.perf_counter()
        time.sleep(ctx.bwd_s)
        _BUSY[0] += time.perf_counter() - t0
        return grad, None, None


class SleepLayer(nn.Module):
    """A tiny linear layer that takes a fixed time: uniform, deterministic stage cost."""

    def __init__(self, fwd_ms: float, bwd_ms: float) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.fwd_s, self.bwd_s = fwd_ms / 1e3, bwd_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.fc(x), self.fwd_s, self.bwd_s)


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: (B, T, C) -> (B, T, C)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def layer_specs(case: dict[str, Any], spec_cls: Any) -> list[Any]:
    if case["model"] == "sleep":
        per_layer = case["stage_ms"] / case["layers_per_stage"]
        n = case["pp"] * case["layers_per_stage"]
        return [spec_cls(SleepLayer, per_layer, 2 * per_layer) for _ in range(n)]
    return [spec_cls(MLPBlock, case["width"]) for _ in range(case["layers"])]


def batches(case: dict[str, Any]) -> Any:
    g = torch.Generator().manual_seed(0)
    width = WIDTH if case["model"] == "sleep" else case["width"]
    shape = (case["micro"], case["seq"], width)
    pool = [(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)) for _ in range(4)]
    i = 0
    while True:
        yield pool[i % len(pool)]
        i += 1


def ds_config(case: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": case["micro"],
        "gradient_accumulation_steps": case["m"],
        "steps_per_print": 10_000,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }


# ---------------------------------------------------------------------------- workers
def _time_batches(
    engine: Any, case: dict[str, Any], barrier: Any
) -> tuple[list[float], list[float]]:
    """Wall time of each timed ``train_batch`` and the time spent inside sleep layers."""
    data = batches(case)
    for _ in range(case["warmup"]):
        engine.train_batch(data)
    times, busy = [], []
    for _ in range(case["repeats"]):
        barrier()
        _BUSY[0] = 0.0
        t0 = time.perf_counter()
        engine.train_batch(data)
        times.append(time.perf_counter() - t0)
        busy.append(_BUSY[0])
    return times, busy


def shardspeed_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.pipe import LayerSpec, PipelineModule

    comm.init_distributed(dist_backend="gloo")
    results = []
    for case in cases:
        v = case.get("virtual", 1)
        net = PipelineModule(
            layer_specs(case, LayerSpec), num_stages=case["pp"], loss_fn=F.mse_loss,
            partition_method="uniform", schedule=case["schedule"], virtual_stages=v,
        )  # fmt: skip
        engine, _, _, _ = shardspeed.initialize(model=net, config=ds_config(case))
        times, busy = _time_batches(engine, case, comm.barrier)
        results.append({**case, "stage": engine.stage_id, "times": times, "busy": busy})
        engine.destroy()
    return results


def deepspeed_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for case in cases:
        net = PipelineModule(
            layer_specs(case, LayerSpec), num_stages=case["pp"], loss_fn=F.mse_loss,
            partition_method="uniform",
        )  # fmt: skip
        params = [p for p in net.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(
            model=net, config=ds_config(case), model_parameters=params
        )
        times, busy = _time_batches(engine, case, dist.barrier)
        results.append({**case, "stage": engine.stage_id, "times": times, "busy": busy})
    return results


def worker_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(args.cases).read_text())
    fn = shardspeed_worker if args.worker == "shardspeed" else deepspeed_worker
    results = fn(cases)
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))


# ---------------------------------------------------------------------------- driver
def launch(python: str, worker: str, nproc: int, cases: list[dict[str, Any]]) -> list[list[dict]]:
    """Run ``cases`` on ``nproc`` ranks with ``python``; returns per-rank results."""
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, out_path = Path(tmp) / "cases.json", Path(tmp) / "out.json"
        cases_path.write_text(json.dumps(cases))
        cmd = [
            python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(29700 + os.getpid() % 200), __file__,
            "--worker", worker, "--cases", str(cases_path), "--out", str(out_path),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"{worker} launch failed (exit {proc.returncode})")
        return json.loads(out_path.read_text())


def idle_rows(per_rank: list[list[dict]], engine: str) -> list[str]:
    rows = []
    for i, case in enumerate(per_rank[0]):
        p, m, v = case["pp"], case["m"], case.get("virtual", 1)
        ideal = (p - 1) / (v * m + p - 1)
        walls = [statistics.median(r[i]["times"]) for r in per_rank]
        by_stage = {
            r[i]["stage"]: statistics.median(1 - b / t for b, t in zip(r[i]["busy"], r[i]["times"]))
            for r in per_rank
        }
        idle = " ".join(f"{by_stage[s]:.3f}" for s in sorted(by_stage))
        name = case["schedule"] + (f" (v={v})" if v > 1 else "")
        rows.append(
            f"| {engine} | {name} | {m} | {ideal:.3f} | {idle} | "
            f"{max(by_stage.values()) - ideal:+.3f} | {max(walls) * 1e3:.0f} |"
        )
    return rows


def analytic_rows(p: int, ms: list[int]) -> list[str]:
    from shardspeed.parallel.pipeline.schedule import all_stage_schedules
    from shardspeed.parallel.pipeline.simulate import simulate, unit_cost

    rows = []
    for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for m in ms:
            streams = [s.instructions() for s in all_stage_schedules(kind, m, p, v)]
            result = simulate(streams, unit_cost(1.0 / v, 2.0 / v), mode="async")
            idle = " ".join(f"{x:.3f}" for x in result.idle_fraction)
            ideal = (p - 1) / (v * m + p - 1)
            rows.append(f"| {kind}{f' (v={v})' if v > 1 else ''} | {m} | {ideal:.3f} | {idle} |")
    return rows


def best_median_ms(rounds: list[list[list[dict]]], i: int) -> str:
    """Case ``i`` over every round and timed batch: ``best / median`` ms (slowest rank)."""
    per_batch = [
        max(rank[i]["times"][k] for rank in per_rank)
        for per_rank in rounds
        for k in range(len(per_rank[0][i]["times"]))
    ]
    return f"{min(per_batch) * 1e3:.0f} / {statistics.median(per_batch) * 1e3:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", choices=["shardspeed", "deepspeed"])
    ap.add_argument("--cases")
    ap.add_argument("--out")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--stage-ms", type=float, default=20.0, help="forward time per stage (ms)")
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per case")
    ap.add_argument("--rounds", type=int, default=2, help="alternating ShardSpeed/DeepSpeed rounds")
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return

    p, ms = 4, [4, 8, 16]
    print("## Analytic bubble (simulator, uniform stages, backward = 2 x forward)\n")
    print("| schedule | m | ideal | idle per stage |\n| --- | --- | --- | --- |")
    print("\n".join(analytic_rows(p, ms)), flush=True)

    sleep = {"model": "sleep", "pp": p, "micro": 2, "seq": 4, "stage_ms": args.stage_ms,
             "layers_per_stage": 2, "warmup": 2, "repeats": args.repeats}  # fmt: skip
    one_f_one_b = [{**sleep, "schedule": "1f1b", "m": m} for m in ms]
    others = [{**sleep, "schedule": "gpipe", "m": m} for m in ms]
    others += [{**sleep, "schedule": "interleaved", "virtual": 2, "m": m} for m in ms]
    mlp = {"model": "mlp", "pp": 2, "micro": 8, "seq": 64, "width": 256, "layers": 8, "m": 8,
           "schedule": "1f1b", "warmup": 2, "repeats": args.repeats}  # fmt: skip
    py_ours = str(ROOT / ".venv" / "bin" / "python")
    py_ds = str(ROOT / ".venv-peers" / "bin" / "python")

    t0 = time.perf_counter()
    ours_others = launch(py_ours, "shardspeed", p, others)
    # Side by side in alternating rounds: this box is shared, so load drifts over minutes.
    rounds: dict[str, list[list[list[dict]]]] = {"ours": [], "ours_mlp": [], "ds": [], "ds_mlp": []}
    for _ in range(args.rounds):
        rounds["ours"].append(launch(py_ours, "shardspeed", p, one_f_one_b))
        rounds["ours_mlp"].append(launch(py_ours, "shardspeed", 2, [mlp]))
        if not args.no_deepspeed:
            rounds["ds"].append(launch(py_ds, "deepspeed", p, one_f_one_b))
            rounds["ds_mlp"].append(launch(py_ds, "deepspeed", 2, [mlp]))

    print(f"\n## Measured bubble, p={p}, sleep stages ({args.stage_ms:g} ms forward + "
          f"{2 * args.stage_ms:g} ms backward per stage and micro-batch), CPU/gloo\n")  # fmt: skip
    print("| engine | schedule | m | ideal | idle per stage (0..3) | worst - ideal | step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(idle_rows(rounds["ours"][0], "ShardSpeed")))
    print("\n".join(idle_rows(ours_others, "ShardSpeed")))
    if rounds["ds"]:
        print("\n".join(idle_rows(rounds["ds"][0], "DeepSpeed 0.19.8")))

    print(f"\n## train_batch time, same model, 1F1B, ZeRO-1 (ms over {args.rounds} alternating "
          f"rounds x {args.repeats} batches: best / median; slowest rank)\n")  # fmt: skip
    print("| model | p | m | ShardSpeed best / median | DeepSpeed 0.19.8 best / median |")
    print("| --- | --- | --- | --- | --- |")
    for label, mine, theirs in (
        ("sleep stages", rounds["ours"], rounds["ds"]),
        ("MLP 8 x 256 wide, micro-batch 8 x 64", rounds["ours_mlp"], rounds["ds_mlp"]),
    ):
        for i, case in enumerate(mine[0][0]):
            cells = [best_median_ms(mine, i), best_median_ms(theirs, i) if theirs else "-"]
            print(f"| {label} | {case['pp']} | {case['m']} | {cells[0]} | {cells[1]} |")
    print(f"\n(total {time.perf_counter() - t0:.0f}s; torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs)")  # fmt: skip


if __name__ == "__main__":
    main()
