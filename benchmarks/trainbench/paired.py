"""``train_bench.py --paired``: every row in one process group, stepped in turn.

A normal round launches each row as its own ``torch.distributed.run``; on a shared machine
the load then changes between rows by more than the engines differ. Paired, one launch
per round builds every row's engine (each on its own copy of the model) and runs step
``i`` of every row before step ``i + 1`` of any, the row order reversed on every other
step, so each ratio compares steps taken seconds apart under the same load. It needs one
interpreter that imports every row's library (``.venv-peers`` has DeepSpeed and torch;
shardspeed comes from this checkout through ``PYTHONPATH``).

Per step and row the worker records the wall time and the process CPU time (all threads:
compute and the collectives' helper threads), both the slowest rank's. Memory is not per
row here (one process holds every engine), so the memory columns stay empty.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from _bench_common import emit_result

from trainbench.engines import EngineRow, build_runner, preload_engine_library, row_label
from trainbench.worker import _gather, _sync, init_process_group, summarize_ranks
from trainbench.workload import Workload, build_model, make_batches


def rows_arg(rows: list[tuple[str, int]]) -> str:
    """``[("deepspeed", 0), ("shardspeed", 0)]`` -> ``"deepspeed:0,shardspeed:0"``."""
    return ",".join(f"{engine}:{stage}" for engine, stage in rows)


def parse_rows(text: str) -> list[EngineRow]:
    return [EngineRow(e, int(s)) for e, s in (item.split(":") for item in text.split(","))]


def paired_worker_main(args: argparse.Namespace) -> int:
    """One rank of a paired launch: build every row, step them in turn, report each."""
    rows = parse_rows(args.paired_rows)
    workload = Workload.from_args(args)
    device = init_process_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    runners, init_s = [], []
    for row in rows:
        preload_engine_library(row.engine)
        model = build_model(workload)
        start = time.perf_counter()
        runners.append(build_runner(row, model, workload, device))
        dist.barrier()
        init_s.append(time.perf_counter() - start)
    losses: list[list[float]] = [[] for _ in rows]
    times: list[list[float]] = [[] for _ in rows]
    cpu: list[list[float]] = [[] for _ in rows]
    for i, (x, y) in enumerate(make_batches(workload, rank, world, device)):
        order = range(len(rows)) if i % 2 == 0 else reversed(range(len(rows)))
        for k in order:
            dist.barrier()
            _sync(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = runners[k].train_step(x, y)
            _sync(device)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            losses[k].append(float(loss.float().item()))
            if i >= workload.warmup:
                times[k].append(elapsed)
                cpu[k].append(elapsed_cpu)
    tokens = world * workload.micro_batch * workload.block_size
    for k, row in enumerate(rows):
        summary = summarize_ranks(losses[k], times[k], device, 0.0, tokens)
        slowest_cpu = [max(ts) for ts in zip(*_gather(cpu[k]))]
        if rank == 0:
            emit_result(_paired_result(row, workload, args, summary, slowest_cpu, init_s[k]))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _paired_result(
    row: EngineRow,
    workload: Workload,
    args: argparse.Namespace,
    summary: dict[str, Any],
    cpu_s: list[float],
    init_s: float,
) -> dict[str, Any]:
    """A row's result in the shape of a normal launch's, memory left out."""
    return {
        "engine": row.engine,
        "stage": row.stage,
        "label": row_label(row.engine, row.stage),
        "device": args.device,
        "torch": torch.__version__,
        "workload": workload.to_dict(),
        **summary,
        "peak_mem_mb_per_rank": [],
        "peak_mem_delta_mb_per_rank": [],
        "cpu_ms": [t * 1e3 for t in cpu_s],
        "init_s": init_s,
        "paired": True,
    }


def launch_paired(
    args: argparse.Namespace, rows: list[tuple[str, int]], python: str, nproc: int, script: str
) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Run ``args.rounds`` paired launches of ``rows``; every row's result of every round."""
    from _bench_common import child_env, run_child
    from tqdm import tqdm

    from trainbench.launch import workload_argv

    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [script, "--worker", "--paired-rows", rows_arg(rows), "--device", args.device]
    cmd += workload_argv(Workload.from_args(args))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {row: [] for row in rows}
    env = child_env(args.threads, args.device)
    for r in tqdm(range(args.rounds), desc="train_bench --paired", unit="launch"):
        log = args.log_dir / f"paired_round{r}.log"
        code, results, tail = run_child(cmd, env, args.timeout * len(rows), log)
        by_row = {(res["engine"], res["stage"]): res for res in results}
        for engine, stage in rows:
            failed = {"status": "error", "error": f"exit code {code}; log {log}\n{tail}"}
            base = {"engine": engine, "stage": stage, "label": row_label(engine, stage)}
            runs[(engine, stage)].append(
                {**base, "log": str(log), **by_row.get((engine, stage), failed)}
            )
    return runs
