"""XTC-style extreme compression of the demo GPT with ``shardspeed.compression``.

Half the layers (``layer_reduction``: the student's blocks start as teacher blocks
``--teacher-layers``, embeddings and final norm copied), then ternary weights
(``{-a, 0, a}`` per row and ``--group-size`` columns, quantized in forward with a
straight-through gradient) on every linear of the blocks, trained by knowledge distillation
from the full fp32 model: soft-label loss on the logits plus the MSE between each student
block's output and its teacher block's. The first ``--fp-steps`` distil the shallow student
in full precision; the compression scheduler switches ternary weights on at that step
(``schedule_offset``). ``redundancy_clean`` then fixes the ternary values; the saved model
(a 2-layer GPT) serves through ``pipeline(quantization="int4")``, whose symmetric int4 grid
holds ``{-a, 0, a}`` exactly.

    python examples/compression/xtc_gpt.py                       # 2 of 4 layers, ternary
    python examples/compression/xtc_gpt.py --steps 600 --fp-steps 150 --out runs/compression/xtc

Needs the demo GPT (``make demo`` writes ``runs/demo``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_TEACHER,
    batches,
    corpus_split,
    linear_names,
    load_teacher,
    model_bytes,
    perplexity,
)

from shardspeed.compression import (  # noqa: E402
    build_compression_hook,
    capture_outputs,
    hidden_state_mse,
    init_compression,
    kd_loss,
    redundancy_clean,
    set_weight_group_size,
)
from shardspeed.models import GPT, GPTConfig  # noqa: E402


def xtc_config(teacher_layers: list[int], weight_bits: int, offset: int) -> dict[str, Any]:
    """Layer reduction to ``teacher_layers`` and ``weight_bits`` (2: ternary, 1: binary)
    weights in forward from step ``offset``."""
    return {
        "compression_training": {
            "layer_reduction": {
                "enabled": True,
                "keep_number_layer": len(teacher_layers),
                "module_name_prefix": "h",
                "teacher_layer": teacher_layers,
                "other_module_name": ["wte", "wpe", "ln_f"],
            },
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "schedule_offset": offset,
                    "quantization_type": "symmetric",
                    "quantize_weight_in_forward": True,
                },
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": weight_bits, "target_bits": weight_bits},
                        "modules": [r"h\.\d+\."],
                    }
                },
            },
        }
    }


def distill(
    teacher: GPT,
    teacher_layers: list[int],
    weight_bits: int,
    group_size: int | None,
    fp_steps: int,
    steps: int,
    lr: float = 1e-3,
    batch: int = 8,
    temperature: float = 1.0,
    hidden_weight: float = 1.0,
    seed: int = 0,
    log_every: int = 100,
    train_tokens: torch.Tensor | None = None,
) -> tuple[GPT, dict[str, Any]]:
    """Build the shallow student, distil it ``steps`` steps (ternary from ``fp_steps``) on
    ``train_tokens`` (default: the demo corpus' training split)."""
    config = xtc_config(teacher_layers, weight_bits, fp_steps)
    shape = {**teacher.config.to_dict(), "n_layer": len(teacher_layers)}
    student = init_compression(GPT(GPTConfig(**shape)), config, teacher_model=teacher)
    set_weight_group_size(student, group_size)
    hook = build_compression_hook(student, config)
    assert hook is not None
    if train_tokens is None:
        train_tokens, _ = corpus_split()
    data = batches(train_tokens, teacher.config.block_size, batch, seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    s_names = [f"h.{i}" for i in range(len(teacher_layers))]
    t_names = [f"h.{i}" for i in range(teacher.config.n_layer)]
    t0 = time.perf_counter()
    student.train()
    for step in range(steps):
        for group in optimizer.param_groups:  # cosine decay to 10% of lr
            group["lr"] = lr * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        x, _ = next(data)
        with torch.no_grad(), capture_outputs(teacher, t_names) as t_hidden:
            t_logits, _ = teacher(x)
        hook.before_forward(step)
        with capture_outputs(student, s_names) as s_hidden:
            s_logits, _ = student(x)
        loss = kd_loss(s_logits, t_logits, temperature)
        loss = loss + hidden_weight * hidden_state_mse(
            s_hidden.outputs, t_hidden.outputs, teacher_layers
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        hook.after_optimizer_step(True)
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - t0:6.0f}s")
    student.eval()
    return student, config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--teacher", default=str(DEFAULT_TEACHER))
    p.add_argument("--teacher-layers", default="1,3", help="teacher blocks the student keeps")
    p.add_argument("--weight-bits", type=int, default=2, choices=[1, 2])
    p.add_argument("--group-size", type=int, default=128, help="columns per scale (0: per row)")
    p.add_argument("--fp-steps", type=int, default=300, help="full-precision distillation first")
    p.add_argument("--steps", type=int, default=1500, help="distillation steps in all")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--out", default=None, help="save the cleaned model here (GPT directory)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    teacher = load_teacher(args.teacher)
    _, held_out = corpus_split()
    layers = [int(v) for v in args.teacher_layers.split(",")]
    group_size = args.group_size or None
    base = perplexity(teacher, held_out, teacher.config.block_size, args.eval_tokens)
    t0 = time.perf_counter()
    student, config = distill(
        teacher, layers, args.weight_bits, group_size, args.fp_steps, args.steps, args.lr,
        args.batch,
    )  # fmt: skip
    redundancy_clean(student, config)
    seconds = time.perf_counter() - t0
    ppl = perplexity(student, held_out, teacher.config.block_size, args.eval_tokens)
    bits = dict.fromkeys(linear_names(student), args.weight_bits)
    ratio = model_bytes(student, bits, group_size) / model_bytes(teacher, {}, None)
    print(
        f"XTC {len(layers)}-of-{teacher.config.n_layer} layers, {args.weight_bits}-bit weights: "
        f"held-out ppl {ppl:.4f} vs fp32 {base:.4f} ({100 * (ppl / base - 1):+.2f}%), model "
        f"bytes {ratio:.3f}x of fp32, {seconds:.0f} s of distillation"
    )
    if args.out:
        student.save_pretrained(args.out)
        print(f"saved {args.out}: serve with pipeline({args.out!r}, quantization='int4')")


if __name__ == "__main__":
    main()
