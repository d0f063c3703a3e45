"""Pipeline schedules: bubble (idle fraction) per stage, and step time next to DeepSpeed.

    .venv/bin/python benchmarks/pipeline_bench.py                 # everything (CPU, gloo)
    .venv/bin/python benchmarks/pipeline_bench.py --no-deepspeed  # ShardSpeed only
    .venv/bin/python benchmarks/pipeline_bench.py --parts gpt --preset small  # quick check

Parts (``--parts``, default all):

1. ``analytic``: every schedule on the simulator's virtual clock (``mode="async"``, the
   engine's semantics), uniform stage cost, backward = 2 x forward (split B = W = F).
2. ``bubble``: the real engine on ``p=4`` ranks where every stage costs the same: each
   layer *sleeps* a fixed time in forward and backward (a sleep does not use a CPU core,
   so four stages on a 2-core machine behave like four devices). Busy time per stage is
   the sum of its sleeps; idle fraction = 1 - busy / train_batch wall time, next to the
   ideal ``(p-1)/(m+p-1)`` (``(p-1)/(v*m+p-1)`` interleaved).
3. ``zb``: the same sleep stages with three costs F = B = W: the weight-gradient cost W
   sleeps in a post-accumulate-grad hook of the layer's ``nn.Linear`` weight, so it runs
   inside the backward under a fused backward and in the W pass under a zero-bubble
   schedule (which defers Linear weight gradients). Every schedule at ``p=4, m=8``,
   measured idle next to the simulator's for the same costs.
4. ``side``: ``train_batch`` time of ShardSpeed's and DeepSpeed's PipelineEngine, same
   model, same 1F1B schedule, CPU/gloo, each in its own torchrun launch (DeepSpeed runs
   from ``.venv-peers``): the sleep model (p=4) and a small real-compute MLP (p=2).
5. ``gpt``: the demo GPT (``--preset``, train_bench's sizes) as a 2-stage
   ``PipelineModule`` (tied embedding/head), fp32, AdamW, ZeRO-1, 1F1B on both engines in
   alternating launches; ShardSpeed-only rows at ZeRO-2/3 (DeepSpeed refuses them) and
   with the zero-bubble schedules.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import signal
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
PARTS = ("analytic", "bubble", "zb", "side", "gpt")
LAUNCH_TIMEOUT_S = 1200  # one torchrun launch; a hung collective ends the benchmark
_BUSY = [0.0]  # seconds this process spent inside SleepLayer forward/backward/weight-grad
# GPT-2 small's shape (the demo GPT at vocab 50304); the other GPT presets are train_bench's
GPT2_SHAPE = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304}  # ~124M


# ---------------------------------------------------------------------------- sleep model
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


def _sleep_after_grad(seconds: float, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: the weight-gradient (W) cost of a SleepLayer."""
    t0 = time.perf_counter()
    time.sleep(seconds)
    _BUSY[0] += time.perf_counter() - t0


class SleepLayer(nn.Module):
    """A tiny linear layer that takes fixed times: forward, input gradient, weight gradient.

    The weight-gradient sleep hangs on ``fc.weight``'s post-accumulate-grad hook: it runs
    inside a fused backward, or in the W pass when a zero-bubble schedule defers it.
    """

    def __init__(self, fwd_ms: float, bwd_ms: float, wgrad_ms: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.fwd_s, self.bwd_s = fwd_ms / 1e3, bwd_ms / 1e3
        if wgrad_ms > 0:
            hook = functools.partial(_sleep_after_grad, wgrad_ms / 1e3)
            self.fc.weight.register_post_accumulate_grad_hook(hook)

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


# ---------------------------------------------------------------------------- GPT layers
class TokenEmbedding(nn.Embedding):
    """The GPT's ``wte``: (B, T) token ids -> (B, T, C); also the LM head's weight."""

    def __init__(self, vocab_size: int, n_embd: int) -> None:
        super().__init__(vocab_size, n_embd)
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class PositionEmbedding(nn.Module):
    """(B, T, C) token embeddings -> + learned position embeddings."""

    def __init__(self, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.wpe = nn.Embedding(block_size, n_embd)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.size(1), device=x.device)  # (T,)
        return x + self.wpe(pos)  # (B, T, C)


def lm_head(wte: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, wte.weight)  # (B, T, C) -> (B, T, V)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


@functools.cache
def gpt_block_class() -> type[nn.Module]:
    """``shardspeed.models.gpt.Block`` with the GPT's own initialisation (one class, so
    ``partition_method="type:GPTBlock"`` finds it on both engines)."""
    from shardspeed.models.gpt import GPT, Block

    class GPTBlock(Block):
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            self.apply(GPT._init_weights)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    return GPTBlock


def gpt_presets() -> list[str]:
    from trainbench.workload import PRESETS

    return sorted([*PRESETS, "gpt2"])


def gpt_shape(preset: str) -> dict[str, int]:
    """Layers, width, heads and vocabulary of a preset: train_bench's ``--preset`` sizes
    (benchmarks/trainbench/workload.py; sequence and micro-batch are this script's own),
    or ``gpt2``."""
    from trainbench.workload import PRESETS, Workload

    if preset == "gpt2":
        return dict(GPT2_SHAPE)
    merged = {**Workload().to_dict(), **PRESETS[preset]}
    return {k: merged[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size")}


def gpt_config(case: dict[str, Any]) -> Any:
    from shardspeed.models.gpt import GPTConfig

    return GPTConfig(block_size=case["seq"], **gpt_shape(case["preset"]))


def gpt_num_parameters(case: dict[str, Any]) -> int:
    """Parameters of the GPT (tied embedding counted once)."""
    shape = gpt_shape(case["preset"])
    d = shape["n_embd"]
    per_block = 12 * d * d + 13 * d  # qkv + proj + MLP weights and biases, two LayerNorms
    return shape["vocab_size"] * d + case["seq"] * d + shape["n_layer"] * per_block + 2 * d


# ---------------------------------------------------------------------------- cases
def layer_specs(case: dict[str, Any], spec_cls: Any, tied_cls: Any) -> list[Any]:
    if case["model"] == "sleep":
        fwd = case["stage_ms"] / case["layers_per_stage"]
        bwd, wgrad = (fwd, fwd) if case.get("split_w") else (2 * fwd, 0.0)
        n = case["pp"] * case["layers_per_stage"]
        return [spec_cls(SleepLayer, fwd, bwd, wgrad) for _ in range(n)]
    if case["model"] == "mlp":
        return [spec_cls(MLPBlock, case["width"]) for _ in range(case["layers"])]
    cfg = gpt_config(case)
    return [
        tied_cls("wte", TokenEmbedding, cfg.vocab_size, cfg.n_embd),
        spec_cls(PositionEmbedding, cfg.block_size, cfg.n_embd),
        *[spec_cls(gpt_block_class(), cfg) for _ in range(cfg.n_layer)],
        spec_cls(nn.LayerNorm, cfg.n_embd),
        tied_cls("wte", TokenEmbedding, cfg.vocab_size, cfg.n_embd, forward_fn=lm_head),
    ]


def seed_torch(seed: Any) -> None:
    """``seed_fn`` for both engines. DeepSpeed's default (``random.seed``) rejects the
    numpy integer its ``type:`` partition makes the layer index on Python 3.11+."""
    torch.manual_seed(int(seed))


def module_args(case: dict[str, Any]) -> dict[str, Any]:
    """``PipelineModule`` arguments shared by both engines."""
    if case["model"] == "gpt":
        return {
            "loss_fn": lm_loss, "partition_method": "type:GPTBlock", "seed_layers": True,
            "seed_fn": seed_torch,
        }  # fmt: skip
    return {"loss_fn": F.mse_loss, "partition_method": "uniform"}


def batches(case: dict[str, Any]) -> Any:
    g = torch.Generator().manual_seed(0)
    if case["model"] == "gpt":
        vocab = gpt_shape(case["preset"])["vocab_size"]
        shape = (case["micro"], case["seq"])  # (B, T) token ids and targets
        pool = [
            (torch.randint(vocab, shape, generator=g), torch.randint(vocab, shape, generator=g))
            for _ in range(4)
        ]
    else:
        width = WIDTH if case["model"] == "sleep" else case["width"]
        shape = (case["micro"], case["seq"], width)
        pool = [
            (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)) for _ in range(4)
        ]
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
        "zero_optimization": {"stage": case.get("zero", 1)},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }


# ---------------------------------------------------------------------------- workers
def _time_batches(engine: Any, case: dict[str, Any], barrier: Any) -> dict[str, list[float]]:
    """Wall time of each timed ``train_batch``, the time spent inside sleep layers, and
    the loss of every batch (warm-up included)."""
    data = batches(case)
    losses = [float(engine.train_batch(data)) for _ in range(case["warmup"])]
    times, busy = [], []
    for _ in range(case["repeats"]):
        barrier()
        _BUSY[0] = 0.0
        t0 = time.perf_counter()
        losses.append(float(engine.train_batch(data)))
        times.append(time.perf_counter() - t0)
        busy.append(_BUSY[0])
    return {"times": times, "busy": busy, "losses": losses}


def shardspeed_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    comm.init_distributed(dist_backend="gloo")
    results = []
    for case in cases:
        extra = {"virtual_stages": case["virtual"]} if "virtual" in case else {}
        net = PipelineModule(
            layer_specs(case, LayerSpec, TiedLayerSpec), num_stages=case["pp"],
            schedule=case["schedule"], **module_args(case), **extra,
        )  # fmt: skip
        engine, _, _, _ = shardspeed.initialize(model=net, config=ds_config(case))
        timed = _time_batches(engine, case, comm.barrier)
        results.append({**case, "stage": engine.stage_id, **timed})
        engine.destroy()
        del engine, net
        gc.collect()
    return results


def deepspeed_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for case in cases:
        net = PipelineModule(
            layer_specs(case, LayerSpec, TiedLayerSpec), num_stages=case["pp"],
            **module_args(case),
        )  # fmt: skip
        params = [p for p in net.parameters() if p.requires_grad]
        try:
            engine, _, _, _ = deepspeed.initialize(
                model=net, config=ds_config(case), model_parameters=params
            )
        except Exception as exc:  # noqa: BLE001  (a refusal is a result here)
            if not case.get("probe_refusal"):
                raise
            results.append({**case, "refused": f"{type(exc).__name__}: {exc}".splitlines()[0]})
            continue
        timed = _time_batches(engine, case, dist.barrier)
        results.append({**case, "stage": engine.stage_id, **timed})
        del engine, net
        gc.collect()
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


# ---------------------------------------------------------------------------- launching
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
        # shardspeed.models.gpt for the peer interpreter too
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # A session of its own, so a hung launch can be ended with all its ranks
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            stderr += f"\n[killed after {LAUNCH_TIMEOUT_S} s]"
        if proc.returncode != 0 or not out_path.exists():
            log = ROOT / "runs" / "pipeline_bench" / f"{worker}_failed.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
            errors = [ln for ln in stderr.splitlines() if ln.startswith("[rank")]
            sys.stderr.write("\n".join(errors[-40:] or stderr.splitlines()[-20:]) + "\n")
            raise SystemExit(f"{worker} launch failed (exit {proc.returncode}); full log: {log}")
        return json.loads(out_path.read_text())


def machine_line() -> str:
    """CPU model (``lscpu``), core count, torch version and the load average now."""
    cpu = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln)
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    peers = sorted(ROOT.glob(".venv-peers/lib/python*/site-packages/deepspeed-*.dist-info"))
    ds = f", DeepSpeed {peers[-1].stem.split('-')[1]}" if peers else ""
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}{ds}, load average {load}"


# ---------------------------------------------------------------------------- schedules
def schedule_kinds() -> tuple[list[str], frozenset[str]]:
    """The training schedules in the tree and the zero-bubble (split backward) ones."""
    from shardspeed.parallel.pipeline import schedule

    return list(schedule.SCHEDULES), frozenset(getattr(schedule, "ZERO_BUBBLE", ()))


def virtual_of(kind: str) -> int:
    """Chunks per stage: 2 for interleaved (as benchmarked) and the V schedules."""
    from shardspeed.parallel.pipeline import schedule

    return 2 if kind == "interleaved" or kind in getattr(schedule, "V_SHAPED", ()) else 1


def simulated_idle(kind: str, m: int, p: int) -> list[float] | None:
    """Per-stage idle fraction on the simulator's clock (async) with per-stage costs
    F = B = W = 1 (a fused backward costs B + W = 2; a chunk of ``v`` costs ``1/v``);
    None when the schedule does not take ``(p, m)``."""
    from shardspeed.parallel.pipeline.schedule import all_stage_schedules, check_schedule_args
    from shardspeed.parallel.pipeline.simulate import simulate, split_cost

    v = virtual_of(kind)
    try:
        check_schedule_args(kind, m, p, v)
    except ValueError:
        return None
    schedules = all_stage_schedules(kind, m, p, v)
    streams = [s.instructions() for s in schedules]
    placement = getattr(schedules[0], "placement", "linear")
    result = simulate(streams, split_cost(1 / v, 1 / v, 1 / v), mode="async", placement=placement)
    return list(result.idle_fraction)


def ideal_idle(kind: str, m: int, p: int) -> float | None:
    """``(p-1)/(v m+p-1)`` for the classic schedules; None for the zero-bubble ones."""
    if kind in schedule_kinds()[1]:
        return None
    return (p - 1) / (virtual_of(kind) * m + p - 1)


def schedule_name(kind: str) -> str:
    return kind + (" (v=2)" if kind == "interleaved" else "")


# ---------------------------------------------------------------------------- tables
def _stage_idle(per_rank: list[list[dict]], i: int) -> dict[int, float]:
    """Case ``i``: median over timed batches of ``1 - busy / wall``, per stage."""
    return {
        r[i]["stage"]: statistics.median(1 - b / t for b, t in zip(r[i]["busy"], r[i]["times"]))
        for r in per_rank
    }


def _fmt_row(values: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in values)


def analytic_rows(p: int, ms: list[int]) -> tuple[list[str], float]:
    """Rows, and the largest |simulated - ideal| over the classic schedules."""
    rows, worst = [], 0.0
    for kind in schedule_kinds()[0]:
        for m in ms:
            idle = simulated_idle(kind, m, p)
            if idle is None:
                continue
            ideal = ideal_idle(kind, m, p)
            if ideal is not None:
                worst = max(worst, *(abs(x - ideal) for x in idle))
            cell = "-" if ideal is None else f"{ideal:.3f}"
            rows.append(f"| {schedule_name(kind)} | {m} | {cell} | {_fmt_row(idle)} |")
    return rows, worst


def idle_rows(per_rank: list[list[dict]], engine: str) -> tuple[list[str], float]:
    """Rows, and the worst (measured - ideal) over the cases."""
    rows, worst = [], -1.0
    for i, case in enumerate(per_rank[0]):
        p, m = case["pp"], case["m"]
        ideal = ideal_idle(case["schedule"], m, p)
        walls = [statistics.median(r[i]["times"]) for r in per_rank]
        by_stage = _stage_idle(per_rank, i)
        excess = max(by_stage.values()) - ideal
        worst = max(worst, excess)
        rows.append(
            f"| {engine} | {schedule_name(case['schedule'])} | {m} | {ideal:.3f} | "
            f"{_fmt_row([by_stage[s] for s in sorted(by_stage)])} | {excess:+.3f} | "
            f"{max(walls) * 1e3:.0f} |"
        )
    return rows, worst


def zb_rows(
    per_rank: list[list[dict]],
) -> tuple[list[str], dict[str, tuple[float, float, float]]]:
    """Rows, and per schedule (mean measured idle, worst relative, worst absolute
    difference to the simulator)."""
    rows, summary = [], {}
    for i, case in enumerate(per_rank[0]):
        kind, p, m = case["schedule"], case["pp"], case["m"]
        sim = simulated_idle(kind, m, p)
        by_stage = _stage_idle(per_rank, i)
        measured = [by_stage[s] for s in sorted(by_stage)]
        rel = [(x - s) / s if s > 0 else float("inf") for x, s in zip(measured, sim)]
        worst = max(rel, key=abs)
        points = max((x - s for x, s in zip(measured, sim)), key=abs)
        summary[kind] = (statistics.fmean(measured), worst, points)
        wall = max(statistics.median(r[i]["times"]) for r in per_rank)
        rows.append(
            f"| {schedule_name(kind)} | {_fmt_row(sim)} | {_fmt_row(measured)} | "
            f"{' '.join(f'{x:+.0%}' for x in rel)} | {worst:+.0%} | {points:+.3f} | "
            f"{wall * 1e3:.0f} |"
        )
    return rows, summary


def _per_batch(rounds: list[list[list[dict]]], i: int) -> list[float]:
    """Case ``i`` over every round and timed batch: the slowest rank's time (s)."""
    return [
        max(rank[i]["times"][k] for rank in per_rank)
        for per_rank in rounds
        for k in range(len(per_rank[0][i]["times"]))
    ]


def best_median_ms(rounds: list[list[list[dict]]], i: int) -> str:
    """Case ``i`` over every round and timed batch: ``best / median`` ms (slowest rank)."""
    per_batch = _per_batch(rounds, i)
    return f"{min(per_batch) * 1e3:.0f} / {statistics.median(per_batch) * 1e3:.0f}"


# ---------------------------------------------------------------------------- parts
class Bench:
    """The parent process: launches, prints each part's table and keeps a summary line."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.py_ours = str(ROOT / ".venv" / "bin" / "python")
        self.py_ds = str(ROOT / ".venv-peers" / "bin" / "python")
        self.deepspeed = not args.no_deepspeed
        self.summary: list[str] = []
        self.p, self.ms = 4, [4, 8, 16]
        self.sleep = {
            "model": "sleep", "pp": self.p, "micro": 2, "seq": 4, "stage_ms": args.stage_ms,
            "layers_per_stage": 2, "warmup": 2, "repeats": args.repeats,
        }  # fmt: skip

    def analytic(self) -> None:
        print("## Analytic bubble (simulator, uniform stages, backward = 2 x forward, "
              "split B = W = F)\n")  # fmt: skip
        print("| schedule | m | ideal | idle per stage |\n| --- | --- | --- | --- |")
        rows, worst = analytic_rows(self.p, self.ms)
        print("\n".join(rows), flush=True)
        self.summary.append(
            f"| analytic | {len(rows)} rows; classic schedules: max abs(simulated - ideal) "
            f"= {worst:.1e} |"
        )

    def bubble_and_side(self, bubble: bool, side: bool) -> None:
        """The measured bubble (classic schedules) and the sleep/MLP side by side share
        their 1F1B launches."""
        args, p, ms = self.args, self.p, self.ms
        one_f_one_b = [{**self.sleep, "schedule": "1f1b", "m": m} for m in ms]
        others = [{**self.sleep, "schedule": "gpipe", "m": m} for m in ms]
        others += [{**self.sleep, "schedule": "interleaved", "virtual": 2, "m": m} for m in ms]
        mlp = {"model": "mlp", "pp": 2, "micro": 8, "seq": 64, "width": 256, "layers": 8,
               "m": 8, "schedule": "1f1b", "warmup": 2, "repeats": args.repeats}  # fmt: skip
        ours_others = launch(self.py_ours, "shardspeed", p, others) if bubble else []
        # Side by side in alternating rounds: this box is shared, so load drifts over minutes.
        rounds: dict[str, list[list[list[dict]]]] = {"ours": [], "mlp": [], "ds": [], "ds_mlp": []}
        for _ in range(args.rounds if side else 1):
            rounds["ours"].append(launch(self.py_ours, "shardspeed", p, one_f_one_b))
            if side:
                rounds["mlp"].append(launch(self.py_ours, "shardspeed", 2, [mlp]))
            if self.deepspeed:
                rounds["ds"].append(launch(self.py_ds, "deepspeed", p, one_f_one_b))
                if side:
                    rounds["ds_mlp"].append(launch(self.py_ds, "deepspeed", 2, [mlp]))

        if bubble:
            print(f"\n## Measured bubble, p={p}, sleep stages ({args.stage_ms:g} ms forward + "
                  f"{2 * args.stage_ms:g} ms backward per stage and micro-batch), CPU/gloo\n")  # fmt: skip
            print("| engine | schedule | m | ideal | idle per stage (0..3) | worst - ideal "
                  "| step ms |\n| --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
            rows, worst_1f1b = idle_rows(rounds["ours"][0], "ShardSpeed")
            more, worst_others = idle_rows(ours_others, "ShardSpeed")
            print("\n".join(rows + more))
            line = (f"| bubble | ShardSpeed worst - ideal: 1F1B {worst_1f1b:+.3f}, "
                    f"GPipe/interleaved {worst_others:+.3f}")  # fmt: skip
            if rounds["ds"]:
                rows, worst_ds = idle_rows(rounds["ds"][0], "DeepSpeed")
                print("\n".join(rows))
                line += f"; DeepSpeed 1F1B {worst_ds:+.3f}"
            self.summary.append(line + " |")
        if side:
            self._print_side(rounds)

    def _print_side(self, rounds: dict[str, list[list[list[dict]]]]) -> None:
        args = self.args
        print(f"\n## train_batch time, same model, 1F1B, ZeRO-1 (ms over {args.rounds} "
              f"alternating rounds x {args.repeats} batches: best / median; slowest rank)\n")  # fmt: skip
        print("| model | p | m | ShardSpeed best / median | DeepSpeed best / median |")
        print("| --- | --- | --- | --- | --- |")
        ratios: list[str] = []
        for label, mine, theirs in (
            ("sleep stages", rounds["ours"], rounds["ds"]),
            ("MLP 8 x 256 wide, micro-batch 8 x 64", rounds["mlp"], rounds["ds_mlp"]),
        ):
            for i, case in enumerate(mine[0][0]):
                cells = [best_median_ms(mine, i), best_median_ms(theirs, i) if theirs else "-"]
                print(f"| {label} | {case['pp']} | {case['m']} | {cells[0]} | {cells[1]} |")
                if theirs:
                    ours_med = statistics.median(_per_batch(mine, i))
                    ratio = ours_med / statistics.median(_per_batch(theirs, i))
                    ratios.append(f"{label.split(',')[0]} m={case['m']} {ratio:.2f}")
        cell = ", ".join(ratios) if ratios else "DeepSpeed skipped"
        self.summary.append(f"| side | ShardSpeed / DeepSpeed median step time: {cell} |")

    def zero_bubble(self) -> None:
        """Every schedule at p=4, m=8 with F = B = W, measured next to the simulator."""
        kinds, split = schedule_kinds()
        m, ms = 8, self.args.zb_stage_ms or self.args.stage_ms
        uniform = {**self.sleep, "stage_ms": ms, "m": m, "split_w": True}
        cases = [
            {**uniform, "schedule": kind, **({"virtual": 2} if kind == "interleaved" else {})}
            for kind in kinds
            if kind != "gpipe" and simulated_idle(kind, m, self.p) is not None
        ]
        per_rank = launch(self.py_ours, "shardspeed", self.p, cases)
        print(f"\n## Measured bubble with a weight-gradient cost, p={self.p}, m={m}, sleep "
              f"stages F = B = W = {ms:g} ms per stage and micro-batch (fused backward "
              f"B + W = {2 * ms:g} ms), ShardSpeed, CPU/gloo\n")  # fmt: skip
        print("| schedule | simulated idle per stage | measured idle per stage | "
              "(measured - sim) / sim | worst | worst measured - sim | step ms |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- |")
        rows, summary = zb_rows(per_rank)
        print("\n".join(rows), flush=True)
        within = all(abs(rel) <= 0.15 for _, rel, _ in summary.values())
        base = summary.get("1f1b", (float("nan"),))[0]
        below = [k for k in summary if k in split and summary[k][0] < base]
        cells = ", ".join(
            f"{k} {idle:.3f} ({rel:+.0%}, {points:+.3f})"
            for k, (idle, rel, points) in summary.items()
        )
        zero_bubble = ", ".join(k for k in summary if k in split) or "-"
        self.summary.append(
            f"| zb | mean measured idle (worst diff to the simulator: relative, absolute): "
            f"{cells}; all within 15%: {'yes' if within else 'no'}; zero-bubble below 1F1B: "
            f"{', '.join(below) or 'none'} of {zero_bubble} |"
        )

    def gpt(self) -> None:
        """The GPT on both engines, alternating launches; every ShardSpeed row runs in the
        same launches (same load) as the 1F1B ZeRO-1 row it is compared with, in an order
        shuffled per round (seeded by the round) so no row always runs first or warmest."""
        args = self.args
        base = {
            "model": "gpt", "preset": args.preset, "pp": 2, "micro": args.gpt_micro,
            "seq": args.gpt_seq, "m": args.gpt_m, "schedule": "1f1b", "zero": 1,
            "warmup": args.gpt_warmup, "repeats": args.gpt_repeats,
        }  # fmt: skip
        kinds, split = schedule_kinds()
        cases = [base, *({**base, "zero": z} for z in (2, 3))]
        cases += [{**base, "schedule": k} for k in kinds if k in split]
        cases = [c for c in cases if simulated_idle(c["schedule"], c["m"], 2) is not None]
        # DeepSpeed's refusal depends on the config only: probe it on a small GPT
        probes = [{**base, "preset": "small", "seq": 16, "zero": z, "probe_refusal": True}
                  for z in (2, 3)]  # fmt: skip
        ours: list[list[list[dict]]] = []
        theirs: list[list[list[dict]]] = []
        refused: dict[int, str] = {}
        for r in range(args.gpt_rounds):
            order = list(range(len(cases)))
            random.Random(r).shuffle(order)
            got = launch(self.py_ours, "shardspeed", 2, [cases[i] for i in order])
            ours.append([[rank[order.index(i)] for i in range(len(cases))] for rank in got])
            if self.deepspeed:
                got = launch(self.py_ds, "deepspeed", 2, [base] + (probes if r == 0 else []))
                theirs.append([rank[:1] for rank in got])
                refused.update({c["zero"]: c["refused"] for c in got[0][1:] if "refused" in c})
        self._print_gpt(base, ours, theirs, refused)

    def _print_gpt(
        self,
        base: dict[str, Any],
        ours: list[list[list[dict]]],
        theirs: list[list[list[dict]]],
        refused: dict[int, str],
    ) -> None:
        args, cfg = self.args, gpt_shape(self.args.preset)
        print(f"\n## GPT '{args.preset}' ({gpt_num_parameters(base) / 1e6:.1f}M unique parameters: "
              f"{cfg['n_layer']} layers x {cfg['n_embd']}, {cfg['n_head']} heads, vocab "
              f"{cfg['vocab_size']}, seq {args.gpt_seq}), pp 2 x dp 1, micro-batch "
              f"{args.gpt_micro}, m={args.gpt_m}, fp32 AdamW, tied embedding/head, CPU/gloo "
              f"(train_batch ms: best / median over {args.gpt_rounds} alternating rounds x "
              f"{args.gpt_repeats} batches; slowest rank)\n")  # fmt: skip
        print("| schedule | ZeRO | ShardSpeed best / median | vs ShardSpeed 1f1b ZeRO 1 | "
              "DeepSpeed best / median | ShardSpeed / DeepSpeed (median) |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- |")
        medians = [statistics.median(_per_batch(ours, i)) for i in range(len(ours[0][0]))]
        theirs_median = statistics.median(_per_batch(theirs, 0)) if theirs else None
        cells = []
        for i, case in enumerate(ours[0][0]):
            kind, zero = case["schedule"], case["zero"]
            name = f"{kind} ZeRO {zero}"
            if not self.deepspeed:
                ds, ratio = "-", "-"
            elif kind != "1f1b":
                ds, ratio = "no such schedule", "-"
            elif zero != 1:
                ds, ratio = ("refused" if zero in refused else "-"), "-"
            else:
                ratio = f"{medians[i] / theirs_median:.2f}"
                ds = best_median_ms(theirs, 0)
            print(f"| {kind} | {zero} | {best_median_ms(ours, i)} | "
                  f"{medians[i] / medians[0]:.2f} | {ds} | {ratio} |")  # fmt: skip
            versus = f" (ShardSpeed / DeepSpeed {ratio})" if ratio != "-" else ""
            cells.append(f"{name} {medians[i] * 1e3:.0f} ms{versus}")
        if refused:
            print("\nDeepSpeed at ZeRO 2/3 (same config on a small GPT; the check does not "
                  "depend on the model): "
                  + "; ".join(f"ZeRO {z}: {msg}" for z, msg in sorted(refused.items())))  # fmt: skip
        losses = f"first-batch loss ShardSpeed {ours[0][-1][0]['losses'][0]:.4f}"
        if theirs:
            losses += f", DeepSpeed {theirs[0][-1][0]['losses'][0]:.4f}"
        print(f"\n({losses}; same seeds, same data)")
        self.summary.append(f"| gpt {args.preset} | median train_batch: {'; '.join(cells)} |")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", choices=["shardspeed", "deepspeed"], help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--stage-ms", type=float, default=20.0, help="forward time per stage (ms)")
    ap.add_argument(
        "--zb-stage-ms", type=float, default=None,
        help="forward time per stage in the zb part (default: --stage-ms); longer sleeps "
        "shrink the share of p2p latency in the measured bubble",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per sleep/MLP case")
    ap.add_argument("--rounds", type=int, default=2, help="alternating ShardSpeed/DeepSpeed rounds")
    g = ap.add_argument_group("gpt part")
    g.add_argument(
        "--preset", choices=gpt_presets(), default="117m",
        help="GPT size: train_bench's presets (1b is for GPUs) or gpt2 (12 x 768, vocab 50304)",
    )  # fmt: skip
    g.add_argument(
        "--gpt-seq",
        type=int,
        default=64,
        help="sequence length (64 keeps the full run under 10 minutes on 2 cores)",
    )
    g.add_argument("--gpt-micro", type=int, default=1, help="micro-batch size")
    g.add_argument("--gpt-m", type=int, default=4, help="micro-batches per batch (GAS)")
    g.add_argument("--gpt-warmup", type=int, default=1)
    g.add_argument("--gpt-repeats", type=int, default=3, help="timed batches per launch")
    g.add_argument("--gpt-rounds", type=int, default=None, help="default: --rounds")
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if bad := [p for p in parts if p not in PARTS]:
        raise SystemExit(f"--parts: unknown {bad}; choose from {','.join(PARTS)}")
    args.gpt_rounds = args.gpt_rounds or args.rounds

    print(f"(machine: {machine_line()})\n", flush=True)
    bench, t0, took = Bench(args), time.perf_counter(), {}
    for name, run in (
        ("analytic", bench.analytic),
        ("zb", bench.zero_bubble),
        ("bubble+side", lambda: bench.bubble_and_side("bubble" in parts, "side" in parts)),
        ("gpt", bench.gpt),
    ):
        if not any(p in parts for p in name.split("+")):
            continue
        start = time.perf_counter()
        run()
        took[name] = time.perf_counter() - start
        sys.stdout.flush()

    print("\n## Summary (one line per part)\n\n| part | result |\n| --- | --- |")
    print("\n".join(bench.summary))
    print(f"\n(total {time.perf_counter() - t0:.0f}s: "
          + ", ".join(f"{k} {v:.0f}s" for k, v in took.items())
          + f"; {machine_line()})")  # fmt: skip


if __name__ == "__main__":
    main()
