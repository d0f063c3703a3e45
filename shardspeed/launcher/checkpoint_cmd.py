"""``shardspeed checkpoint to-fp32 CKPT_DIR OUT``: consolidate an engine checkpoint."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardspeed checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    fp32 = sub.add_parser("to-fp32", help="write the fp32 weights as (sharded) model files")
    fp32.add_argument("checkpoint_dir", help="directory given to save_checkpoint")
    fp32.add_argument("output_dir", help="directory for model files (+ index json if sharded)")
    fp32.add_argument("--tag", default=None, help="tag to convert (default: latest)")
    fp32.add_argument(
        "--safetensors", action="store_true", help="write .safetensors (default: torch .bin)"
    )
    fp32.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB")
    return parser


def main(argv: list[str]) -> int:
    """Entry point; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    from shardspeed.checkpoint.consolidate import convert_to_fp32_files

    try:
        files = convert_to_fp32_files(
            args.checkpoint_dir,
            args.output_dir,
            tag=args.tag,
            safetensors=args.safetensors,
            max_shard_size=args.max_shard_size,
        )
    except ValueError as err:
        sys.stderr.write(f"shardspeed checkpoint: error: {err}\n")
        return 2
    for f in files:
        sys.stdout.write(f"{f}\n")
    return 0
