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
    fp32.add_argument(
        "--no-verify-checksums",
        dest="verify_checksums",
        action="store_false",
        help="skip the sha256 check of the rank files against the manifest (faster)",
    )
    ds = sub.add_parser(
        "from-deepspeed",
        help="convert a trusted DeepSpeed ZeRO-1/2/3 checkpoint (unpickles it) to ShardSpeed's",
    )
    ds.add_argument("ds_checkpoint_dir", help="directory given to DeepSpeed's save_checkpoint")
    ds.add_argument("output_dir", help="ShardSpeed checkpoint directory to write")
    ds.add_argument("--tag", default=None, help="DeepSpeed tag to convert (default: latest)")
    ds.add_argument("--out-tag", default=None, help="tag to write (default: the same name)")
    return parser


def _fail(err: BaseException) -> int:
    """One line on stderr naming the reason; 2 for a bad input, 1 for anything else."""
    reason = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, ValueError):
        reason = f"{type(err).__name__}: {reason}"
    sys.stderr.write(f"shardspeed checkpoint: error: {reason}\n")
    return 2 if isinstance(err, ValueError) else 1


def _from_deepspeed(args: argparse.Namespace) -> list[str]:
    from shardspeed.checkpoint.deepspeed_import import import_deepspeed_checkpoint

    path = import_deepspeed_checkpoint(
        args.ds_checkpoint_dir, args.output_dir, tag=args.tag, out_tag=args.out_tag
    )
    return [str(path)]


def _to_fp32(args: argparse.Namespace) -> list[str]:
    from shardspeed.checkpoint.consolidate import convert_to_fp32_files

    files = convert_to_fp32_files(
        args.checkpoint_dir,
        args.output_dir,
        tag=args.tag,
        safetensors=args.safetensors,
        max_shard_size=args.max_shard_size,
        verify_checksums=args.verify_checksums,
    )
    return [str(f) for f in files]


def main(argv: list[str]) -> int:
    """Entry point; returns the exit status. Every failure is one line on stderr."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    action = _from_deepspeed if args.action == "from-deepspeed" else _to_fp32
    try:
        outputs = action(args)
    except Exception as err:  # any failure: a reason, never a traceback
        return _fail(err)
    for path in outputs:
        sys.stdout.write(f"{path}\n")
    return 0
