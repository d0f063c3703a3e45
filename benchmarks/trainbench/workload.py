"""The one GPT training workload every engine of the side-by-side benchmark runs.

Same model shape, same initial weights (seeded before construction on every rank), same
token stream (generated from a seeded generator, sliced per rank), same optimizer
hyper-parameters and the same gradient clipping. Only the engine differs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

# Optimizer hyper-parameters shared by every engine. weight_decay is explicit because the
# defaults differ: torch.optim.AdamW defaults to 0.01, DeepSpeed's FusedAdam to 0.0.
LR = 3e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0  # DeepSpeed's "gradient_clipping" default is 1.0 too; set explicitly everywhere


@dataclass(frozen=True)
class Workload:
    """Model shape, batch, precision and step counts of one benchmark run."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 8
    block_size: int = 128
    vocab_size: int = 256
    micro_batch: int = 8
    dtype: str = "fp32"  # "fp32" | "bf16"
    steps: int = 10
    warmup: int = 3
    seed: int = 1234
    data_seed: int = 4321
    ds_optimizer: str = "torch"  # "torch": torch.optim.AdamW inside DeepSpeed; "native": FusedAdam
    ds_extra: str = ""  # JSON object deep-merged into the ds_config of DeepSpeed and shardspeed
    compile: str = ""  # torch.compile backend of the shardspeed rows' forward ("": eager)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        return cls(
            n_layer=args.n_layer,
            n_embd=args.n_embd,
            n_head=args.n_head,
            block_size=args.block_size,
            vocab_size=args.vocab_size,
            micro_batch=args.micro_batch,
            dtype=args.dtype,
            steps=args.steps,
            warmup=args.warmup,
            seed=args.seed,
            data_seed=args.data_seed,
            ds_optimizer=args.ds_optimizer,
            ds_extra=args.ds_extra,
            compile=args.compile,
        )


# Named model sizes (``--preset``); explicit flags still override them.
PRESETS: dict[str, dict[str, int]] = {
    "small": {},  # the Workload defaults (about 3.3M parameters)
    # about 21M parameters (16.9M unique: the LM head is tied to the embedding, counted
    # twice as in the 117m name): a CPU size where the gradient all-reduce is a visible part
    # of the step, so overlapping it with backward shows
    "21m": {
        "n_layer": 4,
        "n_embd": 512,
        "n_head": 8,
        "vocab_size": 8192,
        "block_size": 128,
        "micro_batch": 4,
    },  # fmt: skip
    # about 117M parameters: the issue-13 speed check at a size where compute dominates
    "117m": {
        "n_layer": 8,
        "n_embd": 1024,
        "n_head": 16,
        "vocab_size": 8192,
        "block_size": 128,
        "micro_batch": 4,
    },  # fmt: skip
    # about 1.1B parameters (20 x 2048, GPT-2 vocabulary padded to 50304, seq 1024): the GPU
    # training benchmark's size, where MFU is meaningful (one H100: bf16 fits at ZeRO 0-3)
    "1b": {
        "n_layer": 20,
        "n_embd": 2048,
        "n_head": 16,
        "vocab_size": 50304,
        "block_size": 1024,
        "micro_batch": 8,
    },  # fmt: skip
}

# Dense bf16 peak of one device, TFLOP/s, by a substring of torch.cuda.get_device_name()
# (vendor data sheets, SXM parts); MFU is reported against it.
PEAK_BF16_TFLOPS: dict[str, float] = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a known GPU (None: unknown; pass ``--peak-tflops``)."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def flops_per_token(wl: dict[str, Any]) -> float:
    """Training FLOPs per token of the GPT (forward + backward = 3 x forward): 6 per
    weight of every matmul (per layer 12 d^2: qkv 3, proj 1, MLP 8; the LM head V d) plus
    attention's scores and weighted sum, 12 L d T (causal masking not discounted, as in
    the PaLM / nanoGPT MFU formula)."""
    layers, width, seq = wl["n_layer"], wl["n_embd"], wl["block_size"]
    matmul_weights = layers * 12 * width * width + wl["vocab_size"] * width
    return 6.0 * matmul_weights + 12.0 * layers * width * seq


def add_workload_args(parser: argparse.ArgumentParser, defaults: Workload | None = None) -> None:
    """Model-size, batch and step flags shared by the parent and its children.

    ``defaults`` supplies the flag defaults; without it they are the GPT workload's and
    ``--preset`` (named GPT sizes) is offered too.
    """
    d = defaults if defaults is not None else Workload()
    g = parser.add_argument_group("workload")
    if defaults is None:
        g.add_argument(
            "--preset",
            choices=sorted(PRESETS),
            default=None,
            help="a named model size (21m: 4 layers, width 512, vocab 8192, seq 128, micro 4; "
            "117m: 8 layers, width 1024, vocab 8192, seq 128, micro 4; 1b: 20 layers, width "
            "2048, vocab 50304, seq 1024, micro 8)",
        )
    g.add_argument("--n-layer", type=int, default=d.n_layer)
    g.add_argument("--n-embd", type=int, default=d.n_embd)
    g.add_argument("--n-head", type=int, default=d.n_head)
    g.add_argument("--block-size", type=int, default=d.block_size, help="sequence length")
    g.add_argument("--vocab-size", type=int, default=d.vocab_size)
    g.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per rank")
    g.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="training precision (default: fp32 on CPU, bf16 on CUDA)",
    )
    g.add_argument("--steps", type=int, default=d.steps, help="timed steps (after warm-up)")
    g.add_argument("--warmup", type=int, default=d.warmup, help="untimed warm-up steps")
    g.add_argument("--seed", type=int, default=d.seed, help="model-init seed")
    g.add_argument("--data-seed", type=int, default=d.data_seed, help="token-stream seed")
    g.add_argument(
        "--ds-optimizer",
        choices=["torch", "native"],
        default=d.ds_optimizer,
        help="'torch': ds_config optimizer.params.torch_adam=true, so DeepSpeed (and "
        "shardspeed) step the same torch.optim.AdamW as the torch rows; 'native': let "
        "DeepSpeed pick FusedAdam (a JIT-built C++ op on CPU)",
    )

    g.add_argument(
        "--ds-extra",
        default=d.ds_extra,
        help="JSON deep-merged into the ds_config, e.g. '{\"memory_breakdown\": true}' or "
        '\'{"zero_optimization": {"overlap_comm": true}}\'',
    )
    g.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=d.compile,
        help='shardspeed rows only: \'"compile": {"enabled": true, "backend": B}\' '
        "(torch.compile of the model's forward; B defaults to inductor; compiled in warm-up)",
    )


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def build_model(workload: Workload) -> torch.nn.Module:
    """The GPT of this workload, initialised identically on every rank and every engine."""
    from shardspeed.models import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=workload.vocab_size,
        block_size=workload.block_size,
        n_layer=workload.n_layer,
        n_head=workload.n_head,
        n_embd=workload.n_embd,
        dropout=0.0,
    )
    torch.manual_seed(workload.seed)
    return GPT(config)


def make_batches(
    workload: Workload, rank: int, world_size: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) for every step, from one seeded global token stream.

    Each step draws a global batch of ``world_size * micro_batch`` sequences of
    ``block_size + 1`` tokens; rank r takes rows ``[r * micro_batch, (r + 1) * micro_batch)``.
    The stream depends only on ``data_seed`` and the global shape, so every engine sees the
    same tokens.
    """
    gen = torch.Generator().manual_seed(workload.data_seed)
    batches = []
    lo, hi = rank * workload.micro_batch, (rank + 1) * workload.micro_batch
    for _ in range(workload.total_steps):
        tokens = torch.randint(
            0,
            workload.vocab_size,
            (world_size * workload.micro_batch, workload.block_size + 1),
            generator=gen,
        )  # (world * B, T + 1)
        local = tokens[lo:hi].to(device)  # (B, T + 1)
        batches.append((local[:, :-1].contiguous(), local[:, 1:].contiguous()))  # (B, T) each
    return batches


def ds_config(workload: Workload, stage: int) -> dict[str, Any]:
    """The ds_config given to both DeepSpeed and shardspeed for ZeRO ``stage``.

    Everything not set here stays at the library default (bucket sizes, overlap_comm,
    stage-3 persistence threshold, ...): the peer runs as a user would run it.
    """
    params: dict[str, Any] = {
        "lr": LR,
        "betas": list(BETAS),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
    }
    if workload.ds_optimizer == "torch":
        params["torch_adam"] = True
    config = {
        "train_micro_batch_size_per_gpu": workload.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": GRAD_CLIP,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": params},
        "bf16": {"enabled": workload.dtype == "bf16"},
        "zero_optimization": {"stage": stage},
    }
    if workload.ds_extra:
        extra = json.loads(workload.ds_extra)
        if not isinstance(extra, dict):
            raise ValueError(
                f"--ds-extra must be a JSON object, got {workload.ds_extra!r}; "
                "e.g. '{\"memory_breakdown\": true}'"
            )
        config = _deep_merge(config, extra)
    return config


def torch_optimizer(params: Any) -> torch.optim.Optimizer:
    """The optimizer of the torch rows: the same AdamW the ds_config describes."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
