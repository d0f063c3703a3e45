"""DeepSpeed's per-node launcher (``python -m deepspeed.launcher.launch``), on torchrun.

A multi-node backend (``pdsh``) runs this module once per node with the job's
``--world_info`` (see :mod:`shardspeed.launcher.world_info`) and the node's
``--node_rank``. It restricts the node's visible devices to its slots and runs the same
``torchrun`` command the ``shardspeed`` launcher builds (:mod:`shardspeed.launcher.commands`):
``--nnodes`` hosts, ``--nproc_per_node`` = this node's slots, a static rendezvous at
``--master_addr:--master_port``.
"""

from __future__ import annotations

import argparse
import sys

from shardspeed.launcher.commands import build_torchrun_argv
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.world_info import decode_world_info


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """The per-node launcher's flags (DeepSpeed's names)."""
    p = argparse.ArgumentParser(prog="python -m deepspeed.launcher.launch")
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--world_info", default="None")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--save_pid", type=int, default=0)
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p.parse_args(args)


def node_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """``(torchrun argv, environment to add)`` for this node.

    Raises:
        LauncherError: missing ``--world_info`` or a node rank outside the host map.
    """
    if args.world_info == "None":
        raise LauncherError("--world_info is required; the deepspeed runner passes it.")
    world = decode_world_info(args.world_info)
    hosts = list(world)
    if not 0 <= args.node_rank < len(hosts):
        raise LauncherError(
            f"--node_rank {args.node_rank} is out of range for {len(hosts)} host(s) "
            f"({', '.join(hosts)}); use 0..{len(hosts) - 1}."
        )
    slots = world[hosts[args.node_rank]]
    argv = build_torchrun_argv(
        num_nodes=len(hosts),
        nproc_per_node=len(slots),
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        user_script=args.training_script,
        user_args=args.training_script_args,
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        log_dir=None if args.enable_each_rank_log == "None" else args.enable_each_rank_log,
    )
    return argv, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}


def main(args: list[str] | None = None) -> int:
    """Run this node's ranks; returns torchrun's exit status."""
    from shardspeed.launcher.process import run_local

    try:
        argv, env = node_command(parse_args(args))
    except LauncherError as err:
        sys.stderr.write(f"deepspeed.launcher.launch: error: {err}\n")
        return 2
    return run_local(argv, env)


if __name__ == "__main__":
    sys.exit(main())
