"""ZeroQuant post-training quantization of the demo GPT with ``shardspeed.compression``.

Group-wise symmetric weights (8 or 4 bits, one scale per row and ``--group-size``
columns, the int8 / int4 kernels' grouping), token-wise dynamic 8-bit activations on the
inputs of every linear of the transformer blocks, and optional layer-by-layer knowledge
distillation (LKD: block ``i`` of the quantized model learns to reproduce the fp32 block
``i`` on the quantized model's own input to that block, one block after another). Then
``redundancy_clean`` fixes the weights at their quantized values and the model is saved; the
saved weights load exactly into the weight-only kernels of ``pipeline(quantization=...)``.

    python examples/compression/zeroquant_gpt.py                          # W8A8 PTQ
    python examples/compression/zeroquant_gpt.py --weight-bits 4 --lkd-steps 100
    python examples/compression/zeroquant_gpt.py --out runs/compression/w8a8

Needs the demo GPT (``make demo`` writes ``runs/demo``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
    init_compression,
    redundancy_clean,
    set_weight_group_size,
)
from shardspeed.models import GPT  # noqa: E402

BLOCK_LINEARS = r"h\.\d+\."  # every linear of the transformer blocks


def zeroquant_config(weight_bits: int, act_bits: int | None) -> dict[str, Any]:
    """The ``compression_training`` block: weights in forward (straight-through, float
    masters for LKD) from step 0; token-wise (``dynamic``) activations when ``act_bits``."""
    block: dict[str, Any] = {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": True,
            },
            "different_groups": {
                "wq": {
                    "params": {"start_bits": weight_bits, "target_bits": weight_bits},
                    "modules": [BLOCK_LINEARS],
                }
            },
        }
    }
    if act_bits is not None:
        block["activation_quantization"] = {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "quantization_type": "symmetric",
                "range_calibration": "dynamic",
            },
            "different_groups": {"aq": {"params": {"bits": act_bits}, "modules": [BLOCK_LINEARS]}},
        }
    return {"compression_training": block}


def quantize(
    teacher: GPT, weight_bits: int, group_size: int | None, act_bits: int | None
) -> tuple[GPT, dict[str, Any]]:
    """A copy of ``teacher`` with quantization switched on (nothing trained yet)."""
    config = zeroquant_config(weight_bits, act_bits)
    student = init_compression(copy.deepcopy(teacher), config)
    set_weight_group_size(student, group_size)
    hook = build_compression_hook(student, config)
    assert hook is not None
    hook.before_forward(0)  # schedule_offset 0: every technique on from the first forward
    return student, config


def _block_input(model: GPT, x: torch.Tensor, upto: int) -> torch.Tensor:
    """The hidden state ``(B, T, C)`` that enters block ``upto`` of ``model``."""
    pos = torch.arange(x.size(1))
    h = model.wte(x) + model.wpe(pos)  # (B, T, C)
    for block in model.h[:upto]:
        h = block(h)
    return h


def layerwise_distill(
    student: GPT,
    teacher: GPT,
    train_tokens: torch.Tensor,
    steps: int,
    lr: float = 1e-4,
    batch: int = 8,
    seed: int = 0,
) -> list[float]:
    """ZeroQuant's LKD: for each block in order, ``steps`` Adam steps on that block's
    parameters minimising ``MSE(student.h[i](h), teacher.h[i](h))``, ``h`` the quantized
    student's own input to block ``i``. Returns each block's last loss."""
    block_size = teacher.config.block_size
    last = []
    student.train()
    for i, (s_block, t_block) in enumerate(zip(student.h, teacher.h, strict=True)):
        optimizer = torch.optim.Adam(s_block.parameters(), lr=lr)
        data = batches(train_tokens, block_size, batch, seed + i)
        loss = torch.zeros(())
        for _ in range(steps):
            x, _ = next(data)
            with torch.no_grad():
                h = _block_input(student, x, i)
                target = t_block(h)
            loss = nn.functional.mse_loss(s_block(h), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        last.append(loss.item())
    student.eval()
    return last


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--teacher", default=str(DEFAULT_TEACHER))
    p.add_argument("--weight-bits", type=int, default=8, choices=[4, 8])
    p.add_argument("--group-size", type=int, default=128, help="columns per scale (0: per row)")
    p.add_argument("--act-bits", type=int, default=8, help="0: weights only")
    p.add_argument("--lkd-steps", type=int, default=0, help="LKD steps per block (0: pure PTQ)")
    p.add_argument("--lkd-lr", type=float, default=1e-4)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--out", default=None, help="save the cleaned model here (GPT directory)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    teacher = load_teacher(args.teacher)
    train_tokens, held_out = corpus_split()
    block = teacher.config.block_size
    group_size = args.group_size or None
    base = perplexity(teacher, held_out, block, args.eval_tokens)
    t0 = time.perf_counter()
    student, config = quantize(teacher, args.weight_bits, group_size, args.act_bits or None)
    if args.lkd_steps:
        losses = layerwise_distill(student, teacher, train_tokens, args.lkd_steps, args.lkd_lr)
        print(f"LKD: last MSE per block {[f'{v:.2e}' for v in losses]}")
    redundancy_clean(student, config)
    seconds = time.perf_counter() - t0
    ppl = perplexity(student, held_out, block, args.eval_tokens)
    bits = dict.fromkeys(linear_names(student), args.weight_bits)
    ratio = model_bytes(student, bits, group_size) / model_bytes(teacher, {}, None)
    name = f"W{args.weight_bits}" + (f"A{args.act_bits}" if args.act_bits else "")
    print(
        f"{name} g{group_size or 'row'}{' + LKD' if args.lkd_steps else ''}: held-out ppl "
        f"{ppl:.4f} vs fp32 {base:.4f} ({100 * (ppl / base - 1):+.2f}%), model bytes "
        f"{ratio:.3f}x of fp32, {seconds:.0f} s"
    )
    if args.out:
        student.save_pretrained(args.out)
        print(f"saved {args.out}: serve with pipeline({args.out!r}, quantization=...)")


if __name__ == "__main__":
    main()
