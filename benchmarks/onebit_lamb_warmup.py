"""1-bit LAMB at a short warm-up (issue 31): an MLP regression on 2 gloo ranks, 60 steps.

    .venv/bin/python benchmarks/onebit_lamb_warmup.py                       # ShardSpeed rows
    .venv/bin/python benchmarks/onebit_lamb_warmup.py --lr 1e-2 --hidden 256 --batch 64
    .venv-peers/bin/python benchmarks/onebit_lamb_warmup.py --impl deepspeed \\
        --ds-source /tmp/ds0196/deepspeed-0.19.6                              # DeepSpeed 0.19.6

``--impl deepspeed`` loads ``deepspeed/runtime/fp16/onebit/lamb.py`` from an unpacked
DeepSpeed 0.19.6 sdist (``pip download --no-deps --no-binary :all: deepspeed==0.19.6``)
into the peers' DeepSpeed, with a gloo stand-in for its ``NcclBackend`` (the same
arithmetic as its ``compressed_allreduce``: worker/server error feedback, one RMS scale per
worker buffer and per server chunk, sign 0 -> +1; signs travel as floats instead of packed
bits), and emulates its engine: gradients averaged while ``enable_backward_allreduce``,
local afterwards; the first ``step()`` is DeepSpeed's dummy initialisation step.
Final = mean loss of the last 10 steps. Results: docs/onebit.md, "Short warm-ups".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, DIN = 60, 16


def build_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIN, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.Generator().manual_seed(99)
    w1 = torch.randn(DIN, 32, generator=teacher) / DIN**0.5
    w2 = torch.randn(32, 1, generator=teacher) / 32**0.5
    x = torch.randn(args.batch, DIN, generator=torch.Generator().manual_seed(1000 * step + rank))
    y = x @ w1[:, :1] if args.linear else torch.tanh(x @ w1) @ w2
    return x, y


class GlooOnebitBackend:
    """DeepSpeed 0.19.6's ``NcclBackend.compressed_allreduce`` arithmetic on gloo."""

    def __init__(self, mpu: Any = None) -> None:
        self.size = dist.get_world_size()

    def compressed_allreduce(self, buffer_m, worker_error, server_error, local_rank):
        n = buffer_m.numel()
        buf = torch.cat([buffer_m.flatten(), buffer_m.new_zeros(worker_error.numel() - n)])
        buf += worker_error
        scale = torch.linalg.vector_norm(buf) / buf.numel() ** 0.5
        sign = torch.where(buf >= 0, 1.0, -1.0)
        worker_error.set_(buf - scale * sign)
        received = [torch.empty_like(c) for c in sign.chunk(self.size)]
        dist.all_to_all(received, [c.contiguous() for c in sign.chunk(self.size)])
        scales = [torch.empty_like(scale) for _ in range(self.size)]
        dist.all_gather(scales, scale)
        server = (torch.stack(received) * torch.stack(scales).view(-1, 1)).sum(0) / self.size
        server += server_error
        server_scale = torch.linalg.vector_norm(server) / server.numel() ** 0.5
        server_sign = torch.where(server >= 0, 1.0, -1.0)
        server_error.set_(server - server_scale * server_sign)
        signs = [torch.empty_like(server_sign) for _ in range(self.size)]
        dist.all_gather(signs, server_sign)
        server_scales = [torch.empty_like(server_scale) for _ in range(self.size)]
        dist.all_gather(server_scales, server_scale)
        out = torch.cat([s * c for s, c in zip(signs, server_scales)])
        buffer_m.data.copy_(out[:n].view_as(buffer_m))
        return buffer_m


class _EmulatedEngine:
    enable_backward_allreduce = True
    mpu = None
    local_rank = 0


def _deepspeed_rows(args: argparse.Namespace, rank: int) -> list[tuple[str, list[float]]]:
    import deepspeed.comm as ds_comm

    ds_comm.init_distributed("gloo", auto_mpi_discovery=False)
    fake = types.ModuleType("deepspeed.runtime.comm.nccl")
    fake.NcclBackend = GlooOnebitBackend  # type: ignore[attr-defined]
    sys.modules["deepspeed.runtime.comm.nccl"] = fake
    classes = {name: _load(args.ds_source, name) for name in ("adam", "lamb")}
    runs = [
        ("Adam (torch AdamW)", None, None),
        ("OneBitAdam 0.19.6 freeze 10", "adam", 10),
        ("OneBitLamb 0.19.6 freeze 10", "lamb", 10),
        ("OneBitLamb 0.19.6 no compression", "lamb", 10**9),
    ]
    rows = []
    for label, kind, freeze in runs:
        model, engine = build_model(args.hidden), _EmulatedEngine()
        if kind is None:
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        else:
            opt = classes[kind](
                list(model.parameters()), deepspeed=engine, lr=args.lr, freeze_step=freeze
            )
        losses = []
        for step in range(STEPS):
            x, y = batch(args, step, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            if engine.enable_backward_allreduce:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(dist.get_world_size())
            opt.step()
            losses.append(_mean_over_ranks(loss))
        rows.append((label, losses))
    return rows


def _load(source: str, name: str) -> type:
    """``OnebitAdam`` / ``OnebitLamb`` from DeepSpeed 0.19.6's ``onebit/{name}.py``."""
    path = os.path.join(source, f"deepspeed/runtime/fp16/onebit/{name}.py")
    spec = importlib.util.spec_from_file_location(f"ds0196_onebit_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.OnebitAdam if name == "adam" else module.OnebitLamb


def _shardspeed_rows(args: argparse.Namespace, rank: int) -> list[tuple[str, list[float]]]:
    import shardspeed

    runs = [
        ("Adam", "Adam", {}),
        ("Lamb", "Lamb", {}),
        ("OneBitAdam freeze 10", "OneBitAdam", {"freeze_step": 10}),
        ("OneBitLamb freeze 10", "OneBitLamb", {"freeze_step": 10}),
        (
            "OneBitLamb, bias_correction false",
            "OneBitLamb",
            {"freeze_step": 10, "bias_correction": False},
        ),  # fmt: skip
    ]
    rows = []
    for label, kind, params in runs:
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "zero_optimization": {"stage": 0},
            "optimizer": {"type": kind, "params": {"lr": args.lr, **params}},
        }
        engine, _, _, _ = shardspeed.initialize(model=build_model(args.hidden), config=config)
        losses = []
        for step in range(STEPS):
            x, y = batch(args, step, rank)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(_mean_over_ranks(loss))
        engine.destroy()
        rows.append((label, losses))
    return rows


def _mean_over_ranks(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _worker(rank: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        rows = _deepspeed_rows(args, rank)
    else:
        dist.init_process_group("gloo")
        rows = _shardspeed_rows(args, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--impl", choices=["shardspeed", "deepspeed"], default="shardspeed")
    p.add_argument("--ds-source", default="/tmp/ds0196/deepspeed-0.19.6")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--linear", action="store_true", help="a linear teacher instead of tanh")
    p.add_argument("--port", type=int, default=29661)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(args, out), nprocs=2)
        with open(out) as f:
            rows = json.load(f)
    adam = sum(rows[0][1][-10:]) / 10
    print(f"{args.impl}: lr {args.lr}, hidden {args.hidden}, batch {args.batch}/rank, "
          f"{'linear' if args.linear else 'tanh'} teacher, {STEPS} steps, 2 ranks")  # fmt: skip
    for label, losses in rows:
        final = sum(losses[-10:]) / 10
        print(f"  {label:36s} final {final:.4f}  {final / adam:6.2f}x Adam")


if __name__ == "__main__":
    main()
