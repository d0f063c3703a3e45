"""Muon vs AdamW on the demo GPT (examples/train_gpt.py: model, data, config), 2 gloo ranks.

    .venv/bin/python benchmarks/muon_vs_adamw.py                   # 200 steps, ZeRO 1
    .venv/bin/python benchmarks/muon_vs_adamw.py --steps 600 --zero 2 --adamw-lr 6e-3

Every run uses the demo's seed, batches, gradient clipping and WarmupCosineLR schedule; only
the optimizer block differs: AdamW (the demo's: lr 3e-3, betas 0.9/0.95, weight decay 0.01)
and Muon (``muon_lr`` for the hidden matrices, the AdamW settings for embeddings and norms).
Prints the training loss per 25-step block and the first step at which each run's
25-step running mean reaches the first run's final 25-step mean. Results: docs/muon.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

WINDOW = 25
DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _demo_module():
    spec = importlib.util.spec_from_file_location("train_gpt", DEMO)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def runs(args: argparse.Namespace) -> list[tuple[str, dict]]:
    adam = {"weight_decay": 0.01, "betas": [0.9, 0.95]}
    muon = {"muon_lr": args.muon_lr, "adam_lr": args.adamw_lr, "eps": 1e-8, **adam}
    return [
        (f"AdamW lr {args.adamw_lr}", {"type": "AdamW", "params": {"lr": args.adamw_lr, **adam}}),
        (f"Muon lr {args.muon_lr}", {"type": "Muon", "params": muon}),
    ]


def _worker(rank: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    torch.set_num_threads(1)
    import shardspeed
    from shardspeed import comm
    from shardspeed.data import TokenWindows, load_stdlib_corpus
    from shardspeed.models import GPT, GPTConfig
    from shardspeed.runtime.dataloader import RepeatingLoader

    demo = _demo_module()
    demo_args = demo.parse_args(["--steps", str(args.steps), "--zero", str(args.zero)])
    tokens = load_stdlib_corpus()
    train_set = TokenWindows(tokens[: int(tokens.numel() * 0.95)], demo_args.block)
    results = {}
    for label, optimizer in runs(args):
        torch.manual_seed(demo_args.seed)
        config = GPTConfig(
            vocab_size=256,
            block_size=demo_args.block,
            n_layer=demo_args.layers,
            n_head=demo_args.heads,
            n_embd=demo_args.embd,
        )
        ds_config = demo.ds_config(demo_args, False)
        ds_config["optimizer"] = optimizer
        engine, _, loader, _ = shardspeed.initialize(
            model=GPT(config), config=ds_config, training_data=train_set
        )
        data = iter(RepeatingLoader(loader))
        losses, start = [], time.perf_counter()
        for _ in range(args.steps):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            comm.all_reduce(total)
            losses.append(float(total) / comm.get_world_size())
        results[label] = (losses, (time.perf_counter() - start) / args.steps)
        engine.destroy()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def running_mean(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - WINDOW + 1) : i + 1]) / min(i + 1, WINDOW) for i in range(len(values))]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2])
    p.add_argument("--adamw-lr", type=float, default=3e-3)
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--port", type=int, default=29671)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_worker, args=(args, out), nprocs=2)
        with open(out) as f:
            results = json.load(f)
    target = running_mean(next(iter(results.values()))[0])[-1]
    print(f"demo GPT, ZeRO {args.zero}, 2 ranks, {args.steps} steps; target {target:.4f}")
    for label, (losses, seconds) in results.items():
        mean = running_mean(losses)
        hit = next((i + 1 for i, v in enumerate(mean) if i >= WINDOW - 1 and v <= target), None)
        blocks = " ".join(f"{sum(losses[i : i + WINDOW]) / WINDOW:.3f}" for i in range(0, args.steps, WINDOW))  # fmt: skip
        print(f"  {label:16s} {seconds * 1e3:5.0f} ms/step  final {mean[-1]:.4f}  reaches target at step {hit}  | {blocks}")  # fmt: skip


if __name__ == "__main__":
    main()
