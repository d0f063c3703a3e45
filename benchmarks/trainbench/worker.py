"""One benchmark child: every rank of one ``torch.distributed.run`` launch runs this.

It initialises the process group, builds the workload's model, wraps it in one engine,
runs warm-up plus timed steps, gathers step times / losses / peak memory from all ranks,
and rank 0 prints one result line for the parent (see ``_bench_common.emit_result``).

:func:`init_process_group`, :func:`train_row` and :func:`finish_worker` are shared with the
tensor-parallel and Ulysses rows of ``tp_bench.py`` (``trainbench.tp_worker``).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _bench_common import current_rss_mb, emit_result, peak_rss_mb, summarize_times

from trainbench.engines import (
    EngineRow,
    EngineUnavailable,
    Runner,
    build_runner,
    preload_engine_library,
    row_label,
)
from trainbench.workload import Workload, build_model, make_batches

Batch = tuple[torch.Tensor, torch.Tensor]


def init_process_group(device_kind: str) -> torch.device:
    """Join the launch's process group (gloo on CPU, nccl on CUDA); return this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def timed_steps(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: list[Batch],
    warmup: int,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    """Run ``step`` on every batch; return (loss of every step, seconds of each timed step)."""
    losses: list[float] = []
    times: list[float] = []
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        loss = step(x, y)
        _sync(device)
        elapsed = time.perf_counter() - start
        losses.append(float(loss.float().item()))
        if i >= warmup:
            times.append(elapsed)
    return losses, times


def summarize_ranks(
    losses: list[float],
    times: list[float],
    device: torch.device,
    rss_before_mb: float,
    tokens_per_step: int,
) -> dict[str, Any]:
    """Gather every rank's losses, times and peak memory; rank 0 returns the row's numbers.

    A step is as slow as its slowest rank; the loss is the mean over ranks (each rank's
    loss is the mean over its own tokens, and every rank holds the same number of them).
    Other ranks return ``{}``.
    """
    local = {
        "losses": losses,
        "times": times,
        "peak_mb": _peak_memory_mb(device),
        "rss_before_mb": rss_before_mb,
    }
    everyone = _gather(local)
    if dist.get_rank() != 0:
        return {}
    world = len(everyone)
    step_times = [max(r["times"][i] for r in everyone) for i in range(len(times))]
    mean_losses = [sum(r["losses"][i] for r in everyone) / world for i in range(len(losses))]
    stats = summarize_times(step_times)
    return {
        "status": "ok",
        "world_size": world,
        **stats,
        "tokens_per_s": tokens_per_step / (stats["median_ms"] / 1e3),
        "loss_step1": mean_losses[0],
        "loss_final": mean_losses[-1],
        "losses": mean_losses,
        "step_times_ms": [t * 1e3 for t in step_times],
        "peak_mem_mb_per_rank": [r["peak_mb"] for r in everyone],
        "peak_mem_delta_mb_per_rank": [r["peak_mb"] - r["rss_before_mb"] for r in everyone]
        if device.type == "cpu"
        else [r["peak_mb"] for r in everyone],
    }


def train_row(
    make_model: Callable[[], torch.nn.Module],
    make_runner: Callable[[torch.nn.Module], Runner],
    batches: list[Batch],
    warmup: int,
    device: torch.device,
    tokens_per_step: int,
) -> dict[str, Any]:
    """Build the model and its engine, train on ``batches``, return rank 0's row numbers.

    Memory is measured from just before the model is built (the engine's library is
    already imported), so ``peak_mem_delta_mb_per_rank`` is what model + engine + training
    added. ``init_s`` is the engine construction time (the model's is left out).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before_mb = current_rss_mb()
    model = make_model()
    num_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    runner = make_runner(model)
    dist.barrier()
    init_s = time.perf_counter() - t0

    losses, times = timed_steps(runner.train_step, batches, warmup, device)
    summary = summarize_ranks(losses, times, device, rss_before_mb, tokens_per_step)
    if not summary:
        return {}
    return {**summary, "num_params": num_params, "init_s": init_s, "engine_info": runner.info}


def _train(row: EngineRow, workload: Workload, device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    preload_engine_library(row.engine)
    return train_row(
        make_model=lambda: build_model(workload),
        make_runner=lambda model: build_runner(row, model, workload, device),
        batches=make_batches(workload, rank, world, device),
        warmup=workload.warmup,
        device=device,
        tokens_per_step=world * workload.micro_batch * workload.block_size,
    )


def finish_worker(base: dict[str, Any], train: Callable[[], dict[str, Any]]) -> int:
    """Run ``train`` on this rank, report the row from rank 0, leave the group; exit code."""
    code = 0
    try:
        result = train()
    except EngineUnavailable as exc:
        result = {"status": "unavailable", "error": str(exc)} if dist.get_rank() == 0 else {}
    except Exception as exc:  # reported to the parent as a failed row
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        code = 1
    if result and dist.get_rank() == 0:
        emit_result({**base, **result})
    if code == 0:
        dist.barrier()
    dist.destroy_process_group()
    return code


def worker_main(args: argparse.Namespace) -> int:
    """Entry point of one rank; returns the process exit code."""
    row = EngineRow(engine=args.engine, stage=args.stage)
    workload = Workload.from_args(args)
    device = init_process_group(args.device)
    base = {
        "engine": row.engine,
        "stage": row.stage,
        "label": row_label(row.engine, row.stage),
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workload": workload.to_dict(),
    }
    return finish_worker(base, lambda: _train(row, workload, device))
