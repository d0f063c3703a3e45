"""Train the demo GPT as a 2-stage pipeline (1F1B) on the Python standard library's source.

    shardspeed --nproc 2 examples/train_pipeline.py --steps 20
    python examples/train_pipeline.py --steps 20          # re-launches itself on 2 ranks
    shardspeed --nproc 4 examples/train_pipeline.py --stages 2   # pp=2 x dp=2, ZeRO-1

The GPT (``shardspeed.models.gpt``) becomes a layer list: token embedding (tied with the
LM head), position embedding, the transformer blocks, the final LayerNorm, and the LM
head reusing the embedding weight. Stage 0 holds the embedding and the first blocks,
the last stage the remaining blocks and the head; the tied weight's gradients are summed
over both stages. Rank 0 prints the (pipeline-wide) loss every few steps.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch when started directly")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages")
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "interleaved"], default="1f1b")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--gas", type=int, default=4, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-every", type=int, default=5)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- the layers
class PositionEmbedding(nn.Module):
    """(B, T, C) token embeddings -> + learned position embeddings."""

    def __init__(self, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.wpe = nn.Embedding(block_size, n_embd)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.size(1), device=x.device)  # (T,)
        return x + self.wpe(pos)  # (B, T, C)


class TokenEmbedding(nn.Embedding):
    """The GPT's ``wte``: (B, T) token ids -> (B, T, C); also the LM head's weight."""

    def __init__(self, vocab_size: int, n_embd: int) -> None:
        super().__init__(vocab_size, n_embd)
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


def lm_head(wte: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, wte.weight)  # (B, T, C) -> (B, T, V)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def gpt_layers(config) -> list:
    """The demo GPT as a PipelineModule layer list (GPT's own initialisation)."""
    from shardspeed.models.gpt import GPT, Block
    from shardspeed.pipe import LayerSpec, TiedLayerSpec

    class GPTBlock(Block):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.apply(GPT._init_weights)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    return [
        TiedLayerSpec("wte", TokenEmbedding, config.vocab_size, config.n_embd),
        LayerSpec(PositionEmbedding, config.block_size, config.n_embd),
        *[LayerSpec(GPTBlock, config) for _ in range(config.n_layer)],
        LayerSpec(nn.LayerNorm, config.n_embd),
        TiedLayerSpec("wte", TokenEmbedding, config.vocab_size, config.n_embd, forward_fn=lm_head),
    ]


# ---------------------------------------------------------------------------- training
def relaunch(args: argparse.Namespace) -> int:
    """Started directly (no torchrun env): run this script on --nproc ranks via our launcher."""
    cmd = [sys.executable, "-m", "shardspeed.launcher.cli", "--nproc", str(args.nproc), __file__]
    cmd += [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"launching {args.nproc} ranks: {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd, env=env)


def ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.lr, "weight_decay": 0.01, "betas": [0.9, 0.95]},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": args.steps, "warmup_num_steps": max(args.steps // 20, 2)},
        },
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": torch.cuda.is_available()},
    }


def train(args: argparse.Namespace) -> None:
    import shardspeed
    from shardspeed import comm
    from shardspeed.data import TokenWindows, load_stdlib_corpus
    from shardspeed.models import GPTConfig
    from shardspeed.pipe import PipelineModule

    comm.init_distributed()
    rank = comm.get_rank()
    config = GPTConfig(
        vocab_size=256,
        block_size=args.block,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.embd,
    )
    net = PipelineModule(
        gpt_layers(config),
        num_stages=args.stages,
        loss_fn=lm_loss,
        seed_layers=True,
        base_seed=args.seed,
        partition_method="type:GPTBlock",  # balance the transformer blocks
        schedule=args.schedule,
        virtual_stages=2 if args.schedule == "interleaved" else 1,
    )
    train_set = TokenWindows(load_stdlib_corpus(max_bytes=1_000_000), args.block)
    engine, _, _, _ = shardspeed.initialize(
        model=net, config=ds_config(args), training_data=train_set
    )
    print(
        f"rank {rank}: stage {engine.stage_id}/{engine.num_stages} holds layers "
        f"{[net.stage_layer_indices(c) for c in range(net.virtual_stages)]} "
        f"({sum(p.numel() for p in net.parameters()):,} parameters)",
        flush=True,
    )
    losses: list[float] = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        losses.append(float(engine.train_batch()))
        if rank == 0 and (step % args.print_every == 0 or step == 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  lr {engine.get_lr()[0]:.2e}", flush=True)
    elapsed = time.perf_counter() - t_start
    if rank == 0:
        tokens = engine.train_batch_size() * args.block * args.steps
        print(
            f"\n{args.stages}-stage {args.schedule} pipeline, {comm.get_world_size()} ranks: loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps "
            f"({elapsed:.1f}s, {tokens / elapsed:,.0f} tokens/s)"
        )
    engine.destroy()


def main() -> int:
    args = parse_args()
    if "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:
        return relaunch(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
