"""ZeRO-3 step time with qgZ's reduction overlapped with backward vs run synchronously.

    .venv/bin/python benchmarks/qgz_overlap_bench.py                        # 2 ranks, one host
    .venv/bin/python benchmarks/qgz_overlap_bench.py --world 4 --hosts aabb # 2 hosts x 2

A demo-family GPT (``shardspeed.models.GPT``, random tokens) trained with ZeRO-3 on gloo
ranks, one torch thread per rank. Rows, each built in turn in the same ranks and rounds
interleaved (the order shuffled per round, the same on every rank):

* ``plain``: ZeRO-3 without ZeRO++ (the asynchronous reduce-scatter);
* ``qgZ overlapped``: ``zero_quantized_gradients``, the library's path (stage 1 started
  from the grad hook, stage 2 chained at the next launch: ``zero/zeropp/grads.py``);
* ``qgZ synchronous``: the same, with every launch waiting for its bucket at once (the
  order qgZ ran in before it overlapped; patched here, not a library option);
* ``qgZ at flush``: ``overlap_comm: false``, every bucket reduced after backward.

Prints the median step time (forward + backward + step) of each row, its quartiles and its
ratio to ``qgZ synchronous``, and the median time per step spent inside qgZ's launches
(rank 0): what the grad hooks hold backward up for. The first ``--warmup`` steps of each
engine are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

ROWS = ["plain", "qgZ overlapped", "qgZ synchronous", "qgZ at flush"]


def _config(row: str, micro: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if row != "plain":
        zero["zero_quantized_gradients"] = True
    if row == "qgZ at flush":
        zero["overlap_comm"] = False
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }


def _timed_launch(launch: Any, synchronous: bool, spent: list[float]) -> Any:
    """``launch`` adding its time to ``spent[0]`` (and waiting at once if ``synchronous``)."""

    def timed(self: Any, buf: torch.Tensor, shard: Any) -> Any:
        start = time.perf_counter()
        launched = launch(self, buf, shard)
        if synchronous and launched.work is not None:
            launched.work.wait()
        spent[0] += time.perf_counter() - start
        return launched

    return timed


def _time_row(row: str, args: argparse.Namespace, rank: int) -> tuple[list[float], list[float]]:
    """Step times and, per step, the time spent inside qgZ's launches (grad hooks)."""
    import shardspeed
    from shardspeed.models import GPT, GPTConfig
    from shardspeed.zero.zeropp import grads

    torch.manual_seed(0)
    config = GPTConfig(block_size=args.block, n_layer=args.layers, n_embd=args.embd, n_head=4)
    engine, *_ = shardspeed.initialize(model=GPT(config), config=_config(row, args.micro))
    launch, spent = grads.QuantizedReduction.launch, [0.0]
    timed = _timed_launch(launch, row == "qgZ synchronous", spent)
    grads.QuantizedReduction.launch = timed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    times, in_launch = [], []
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, config.vocab_size, (args.micro, args.block), generator=g)
            spent[0] = 0.0
            start = time.perf_counter()
            _, loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
                in_launch.append(spent[0])
    finally:
        grads.QuantizedReduction.launch = launch  # type: ignore[method-assign]
        engine.destroy()
    return times, in_launch


def _worker(rank: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
        WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank), SHARDSPEED_HOST_ID=args.hosts[rank],
    )  # fmt: skip
    torch.set_num_threads(1)
    from shardspeed import comm

    comm.init_distributed(dist_backend="gloo")
    order = random.Random(args.seed)  # the same row order on every rank
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    in_launch: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(args.rounds):
        rows = list(ROWS)
        order.shuffle(rows)
        for row in rows:
            step_times, launch_times = _time_row(row, args, rank)
            times[row] += step_times
            in_launch[row] += launch_times
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "in_launch": in_launch}, f)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hosts", default=None, help="fake host of each rank, e.g. aabb (default one)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per row and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29683)
    args = p.parse_args()
    args.hosts = args.hosts or "a" * args.world
    if len(args.hosts) != args.world:
        p.error(f"--hosts {args.hosts!r}: give one letter per rank ({args.world}), e.g. 'aabb'")
    load_before = open("/proc/loadavg").read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_worker, args=(args, out), nprocs=args.world)
        with open(out) as f:
            got = json.load(f)
    times, in_launch = got["times"], got["in_launch"]
    load_after = open("/proc/loadavg").read().split()[:3]
    params = args.layers * 12 * args.embd**2 + 256 * args.embd + args.block * args.embd
    print(
        f"GPT ~{params / 1e6:.1f}M params ({args.layers} layers, embd {args.embd}), micro "
        f"{args.micro} x {args.block}, ZeRO-3, {args.world} gloo ranks, hosts {args.hosts}, "
        f"{args.rounds} rounds x {args.steps} steps; load average {' '.join(load_before)} -> "
        f"{' '.join(load_after)}"
    )
    sync = statistics.median(times["qgZ synchronous"])
    print("| row | median ms/step | quartiles ms | vs qgZ synchronous | ms/step in qgZ launches |")
    print("| --- | --- | --- | --- | --- |")
    for row in ROWS:
        median = statistics.median(times[row])
        low, _, high = statistics.quantiles(times[row], n=4)
        hooks = statistics.median(in_launch[row]) * 1e3 if row != "plain" else float("nan")
        print(
            f"| {row} | {median * 1e3:.1f} | {low * 1e3:.0f}-{high * 1e3:.0f} | "
            f"{median / sync:.3f} | {hooks:.1f} |"
        )


if __name__ == "__main__":
    main()
