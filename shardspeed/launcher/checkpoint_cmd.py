"""``shardspeed checkpoint to-fp32 CKPT_DIR OUT``: consolidate an engine checkpoint;
``shardspeed checkpoint from-deepspeed DS_CKPT OUT``: import a DeepSpeed ZeRO-1/2/3 checkpoint."""

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
    ds = sub.add_parser(
        "from-deepspeed",
        help="convert a trusted DeepSpeed ZeRO-1/2/3 checkpoint (unpickles it) to ShardSpeed's",
    )
    ds.add_argument("ds_checkpoint_dir", help="directory given to DeepSpeed's save_checkpoint")
    ds.add_argument("output_dir", help="ShardSpeed checkpoint directory to write")
    ds.add_argument("--tag", default=None, help="DeepSpeed tag to convert (default: latest)")
    ds.add_argument("--out-tag", default=None, help="tag to write (default: the same name)")
    return parser


def _from_deepspeed(args: argparse.Namespace) -> int:
    from shardspeed.checkpoint.deepspeed_import import import_deepspeed_checkpoint

    try:
        path = import_deepspeed_checkpoint(
            args.ds_checkpoint_dir, args.output_dir, tag=args.tag, out_tag=args.out_tag
        )
    except ValueError as err:
        sys.stderr.write(f"shardspeed checkpoint: error: {err}\n")
        return 2
    sys.stdout.write(f"{path}\n")
    return 0


def main(argv: list[str]) -> int:
    """Entry point; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.action == "from-deepspeed":
        return _from_deepspeed(args)
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
