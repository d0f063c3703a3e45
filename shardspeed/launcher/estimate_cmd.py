"""``shardspeed estimate --params 7e9 --gpus 8``: memory per device and per node for model
states at ZeRO stages 1-3, with and without CPU offload (see shardspeed.zero.estimate)."""

from __future__ import annotations

import argparse
import sys

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _count(text: str) -> float:
    """``7e9``, ``7000000000``, ``7_000_000_000`` or ``7B`` / ``350M`` / ``125K``."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(cleaned[-1:].upper())
    try:
        value = float(cleaned[:-1]) * scale if scale else float(cleaned)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count; write e.g. 7e9, 7000000000 or 7B"
        ) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count cannot be negative")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardspeed estimate", description=__doc__)
    parser.add_argument(
        "--params", type=_count, required=True, help="trainable parameters (7e9, 7B, ...)"
    )
    parser.add_argument("--gpus", type=_positive, default=1, help="devices per node (default 1)")
    parser.add_argument("--nodes", type=_positive, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--largest-layer-params",
        type=_count,
        default=0.0,
        metavar="L",
        help="parameters of the largest layer/unit; stage 3 holds 2 x L gathered while "
        "computing (default 0: not included)",
    )
    parser.add_argument(
        "--stage",
        choices=("1", "2", "3", "all"),
        default="all",
        help="ZeRO stage(s) to show (default all)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(_DTYPE_BYTES),
        default="bf16",
        help="training dtype of parameters (default bf16; masters are fp32)",
    )
    parser.add_argument(
        "--grad-accum-fp32",
        action="store_true",
        help="16-bit gradients accumulated in fp32 (the default when GAS > 1)",
    )
    parser.add_argument(
        "--optimizer-state-bytes",
        type=int,
        default=8,
        help="optimizer state bytes per parameter (Adam/AdamW: 8; SGD momentum: 4)",
    )
    return parser


def main(argv: list[str]) -> int:
    """Print the estimate table; returns the exit status."""
    from shardspeed.zero.estimate import estimate_table

    args = _parser().parse_args(argv)
    stages = (1, 2, 3) if args.stage == "all" else (int(args.stage),)
    param_bytes = _DTYPE_BYTES[args.dtype]
    text, _ = estimate_table(
        args.params,
        stages,
        num_gpus_per_node=args.gpus,
        num_nodes=args.nodes,
        largest_layer_params=args.largest_layer_params,
        param_bytes=param_bytes,
        grad_bytes=4 if args.grad_accum_fp32 else param_bytes,
        optimizer_state_bytes=args.optimizer_state_bytes,
    )
    sys.stdout.write(text + "\n")
    return 0
