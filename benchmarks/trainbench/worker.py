"""One benchmark child: every rank of one ``torch.distributed.run`` launch runs this.

It initialises the process group, builds the workload's model, wraps it in one engine,
runs warm-up plus timed steps, gathers step times / losses / peak memory from all ranks,
and rank 0 prints one result line for the parent (see ``_bench_common.emit_result``).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from _bench_common import current_rss_mb, emit_result, peak_rss_mb, summarize_times

from trainbench.engines import (
    EngineRow,
    EngineUnavailable,
    build_runner,
    preload_engine_library,
    row_label,
)
from trainbench.workload import Workload, build_model, make_batches


def _init_process_group(device_kind: str) -> torch.device:
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


def _train(row: EngineRow, workload: Workload, device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    preload_engine_library(row.engine)
    batches = make_batches(workload, rank, world, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before_mb = current_rss_mb()

    model = build_model(workload)
    num_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    runner = build_runner(row, model, workload, device)
    dist.barrier()
    init_s = time.perf_counter() - t0

    losses: list[float] = []
    times: list[float] = []
    for i, (x, y) in enumerate(batches):
        if i == workload.warmup:
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        loss = runner.train_step(x, y)
        _sync(device)
        elapsed = time.perf_counter() - start
        losses.append(float(loss.float().item()))
        if i >= workload.warmup:
            times.append(elapsed)

    local = {
        "losses": losses,
        "times": times,
        "peak_mb": _peak_memory_mb(device),
        "rss_before_mb": rss_before_mb,
    }
    everyone = _gather(local)
    if rank != 0:
        return {}
    # A step is as slow as its slowest rank; the loss is the mean over ranks' micro-batches.
    step_times = [max(r["times"][i] for r in everyone) for i in range(len(times))]
    mean_losses = [sum(r["losses"][i] for r in everyone) / world for i in range(len(losses))]
    stats = summarize_times(step_times)
    tokens_per_step = world * workload.micro_batch * workload.block_size
    return {
        "status": "ok",
        "world_size": world,
        "num_params": num_params,
        "init_s": init_s,
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
        "engine_info": runner.info,
    }


def worker_main(args: argparse.Namespace) -> int:
    """Entry point of one rank; returns the process exit code."""
    row = EngineRow(engine=args.engine, stage=args.stage)
    workload = Workload.from_args(args)
    device = _init_process_group(args.device)
    base = {
        "engine": row.engine,
        "stage": row.stage,
        "label": row_label(row.engine, row.stage),
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workload": workload.to_dict(),
    }
    code = 0
    try:
        result = _train(row, workload, device)
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
