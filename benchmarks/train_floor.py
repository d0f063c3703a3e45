"""The lower bound of any data-parallel engine's step on the side-by-side GPT workload.

Times, on every rank and interleaved step by step in one process, (a) the model's forward
and backward alone (no gradient communication, no clipping, no optimizer step) and (b) a
whole DDP step (forward, backward with bucketed all-reduce, clipping 1.0, AdamW). ``a / b``
is the best step-time ratio against DDP that any engine running the model's own kernels can
reach; DeepSpeed's ZeRO stage 0 runs at DDP's speed on this workload
(docs/benchmarks.md, issue 13).

Usage::

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/train_floor.py
    ... benchmarks/train_floor.py --preset 117m --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainbench.workload import (  # noqa: E402
    BETAS,
    GRAD_CLIP,
    LR,
    PRESETS,
    WEIGHT_DECAY,
    Workload,
    build_model,
    make_batches,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    workload = Workload(**{**PRESETS[args.preset], "steps": args.steps, "warmup": args.warmup})
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(workload, rank, world, torch.device("cpu"))
    plain = build_model(workload)
    ddp = DistributedDataParallel(build_model(workload))
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> None:
        plain(x, y)[1].backward()
        plain.zero_grad(set_to_none=True)

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        ddp(x, y)[1].backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs: list[tuple[Callable[[torch.Tensor, torch.Tensor], None], list[float]]] = [
        (forward_backward, []),
        (ddp_step, []),
    ]
    for i, (x, y) in enumerate(batches):
        for fn, times in runs:
            dist.barrier()
            start = time.perf_counter()
            fn(x, y)
            if i >= workload.warmup:
                times.append(time.perf_counter() - start)
    floor, step = (statistics.median(times) for _, times in runs)
    if rank == 0:
        print(
            f"{args.preset}: forward+backward alone {floor * 1e3:.1f} ms, DDP step "
            f"{step * 1e3:.1f} ms, floor / DDP = {floor / step:.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
