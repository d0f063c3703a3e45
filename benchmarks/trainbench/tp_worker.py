"""One child of ``tp_bench.py``: every rank of one tensor-parallel or Ulysses launch runs this.

A row is ``(kind, engine, degree)``: ``kind`` "tp" trains :mod:`trainbench.llama`'s Llama
with AutoTP at ``degree`` ranks per tensor group; ``kind`` "ulysses" trains
:mod:`trainbench.ulysses`'s model with the sequence split over ``degree`` ranks ("full" runs
it unsplit on one rank). Timing, memory and the report line are :mod:`trainbench.worker`'s.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainbench.engines import preload_engine_library
from trainbench.llama import LlamaWorkload, build_llama, build_tp_runner
from trainbench.ulysses import build_sequence_lm, build_ulysses_runner, shard_tokens
from trainbench.worker import finish_worker, init_process_group, train_row
from trainbench.workload import make_batches

ROW_KINDS = ("tp", "ulysses")


@dataclass(frozen=True)
class ParallelRow:
    """One launch of ``tp_bench.py``: what is trained, by which engine, over how many ranks."""

    kind: str  # "tp" | "ulysses"
    engine: str  # "deepspeed" | "shardspeed" | "full" (ulysses only)
    degree: int  # tensor- or sequence-parallel size

    @property
    def nproc(self) -> int:
        """Ranks of the launch (the tp/sp group spans every rank; ``full`` runs on one)."""
        return 1 if self.engine == "full" else self.degree

    @property
    def label(self) -> str:
        """Table name, e.g. ``shardspeed AutoTP tp=2`` or ``DeepSpeed Ulysses sp=2``."""
        if self.engine == "full":
            return "full attention, 1 rank"
        name = {"deepspeed": "DeepSpeed", "shardspeed": "shardspeed"}[self.engine]
        method = "AutoTP tp" if self.kind == "tp" else "Ulysses sp"
        return f"{name} {method}={self.degree}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "engine": self.engine, "degree": self.degree}


def _train_tp(row: ParallelRow, workload: LlamaWorkload, stage: int, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % row.degree:
        raise ValueError(f"--tp {row.degree} does not divide the {world} ranks of this launch")
    dp = world // row.degree  # tensor axis innermost: ranks r and r+1 share a data index
    preload_engine_library(row.engine)
    return train_row(
        make_model=lambda: build_llama(workload),
        make_runner=lambda model: build_tp_runner(row.engine, model, workload, stage, row.degree),
        batches=make_batches(workload, rank // row.degree, dp, device),
        warmup=workload.warmup,
        device=device,
        tokens_per_step=dp * workload.micro_batch * workload.block_size,
    )


def _train_ulysses(row: ParallelRow, workload: LlamaWorkload, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != row.nproc:
        raise ValueError(f"Ulysses row {row.label} needs {row.nproc} ranks, launched with {world}")
    preload_engine_library(row.engine)
    sp = row.nproc
    batches = [  # every rank: the same samples, its own s/sp tokens of each
        (shard_tokens(x, sp, rank), shard_tokens(y, sp, rank))
        for x, y in make_batches(workload, 0, 1, device)
    ]
    return train_row(
        make_model=lambda: build_sequence_lm(workload, row.engine, sp),
        make_runner=lambda model: build_ulysses_runner(model, sp),
        batches=batches,
        warmup=workload.warmup,
        device=device,
        tokens_per_step=workload.micro_batch * workload.block_size,
    )


def train_parallel_row(
    row: ParallelRow, workload: LlamaWorkload, stage: int, device: torch.device
) -> dict[str, Any]:
    """Train ``row`` on this rank (the process group is up); rank 0 gets the numbers."""
    if row.kind == "tp":
        return _train_tp(row, workload, stage, device)
    if row.kind == "ulysses":
        return _train_ulysses(row, workload, device)
    raise ValueError(f"row kind {row.kind!r} is not known; use one of {', '.join(ROW_KINDS)}")


def tp_worker_main(args: argparse.Namespace) -> int:
    """Entry point of one rank of a ``tp_bench.py`` launch; returns the exit code."""
    row = ParallelRow(kind=args.kind, engine=args.engine, degree=args.degree)
    workload = LlamaWorkload.from_args(args)
    device = init_process_group(args.device)
    base = {
        **row.to_dict(),
        "label": row.label,
        "stage": args.stage,
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workload": workload.to_dict(),
    }
    return finish_worker(base, lambda: train_parallel_row(row, workload, args.stage, device))
