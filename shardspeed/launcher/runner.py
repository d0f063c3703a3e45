"""DeepSpeed's ``deepspeed.launcher.runner``: the ``deepspeed`` command's entry point.

``main`` is ShardSpeed's launcher (:func:`shardspeed.launcher.cli.main`), which takes
DeepSpeed's launcher options (``--num_gpus``, ``--num_nodes``, ``--hostfile``,
``--include``/``--exclude``, ``--master_addr``/``--master_port``, ``--no_local_rank``, ...)
and passes ``--local_rank=N`` to the script as DeepSpeed does. The compatibility
distribution installs a ``deepspeed`` console command pointing here.

The helpers DeepSpeed's runner exposes are faces over ShardSpeed's launcher code:
:func:`fetch_hostfile` and the ``--include``/``--exclude`` filters over
:mod:`shardspeed.launcher.hostfile`, :func:`encode_world_info` over
:mod:`shardspeed.launcher.world_info`, and :func:`parse_args` returns DeepSpeed's argument
namespace, the input of :mod:`shardspeed.launcher.multinode_runner`'s backends.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from shardspeed.launcher.cli import main as _launcher_main
from shardspeed.launcher.constants import PDSH_LAUNCHER, PDSH_MAX_FAN_OUT
from shardspeed.launcher.environment import ENV_FILE_NAMES
from shardspeed.launcher.hostfile import (
    ResourcePool,
    limit_resources,
    pool_from_hostfile,
    read_hostfile,
    select_resources,
)
from shardspeed.launcher.plan import DEFAULT_HOSTFILE
from shardspeed.launcher.world_info import decode_world_info, encode_world_info
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "EXPORT_ENVS",
    "PDSH_MAX_FAN_OUT",
    "apply_num_nodes_and_gpus",
    "decode_world_info",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]

DLTS_HOSTFILE = DEFAULT_HOSTFILE
# Prefixes of the launcher's variables DeepSpeed's backends export to every node.
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
# The env file of VAR=VALUE lines exported to remote nodes (DS_ENV_FILE overrides it).
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ENV_FILE_NAMES[0])
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
_LAUNCHERS = "pdsh, openmpi, mvapich, slurm, mpich, impi"


def main(args: list[str] | None = None) -> int:
    """Run the launcher on ``args`` (default: ``sys.argv[1:]``); returns the exit status."""
    return _launcher_main(sys.argv[1:] if args is None else list(args))


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's runner flags, with DeepSpeed's defaults, as an ``argparse.Namespace``.

    The namespace is what the backends of :mod:`shardspeed.launcher.multinode_runner`
    take. The ``deepspeed`` command itself parses with :func:`shardspeed.launcher.cli.main`.
    """
    p = argparse.ArgumentParser(
        description="DeepSpeed-style runner: launch multi-node/multi-GPU training jobs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("-H", "--hostfile", type=str, default=DLTS_HOSTFILE, help="'host slots=N' file")
    p.add_argument(
        "-i", "--include", type=str, default="", help="NAME[:SLOT[,SLOT]]@NAME... to use"
    )
    p.add_argument("-e", "--exclude", type=str, default="", help="NAME[:SLOT[,SLOT]]@... to skip")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N hosts")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, help="slots per node")
    p.add_argument("--master_port", type=int, default=29500, help="rendezvous port")
    p.add_argument("--master_addr", type=str, default="", help="address of node 0")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank (--no_ssh)")
    p.add_argument("--launcher", type=str, default=PDSH_LAUNCHER, help=_LAUNCHERS)
    p.add_argument("--launcher_args", type=str, default="", help="extra backend arguments")
    p.add_argument("--module", action="store_true", help="run the script as python -m")
    p.add_argument("--no_python", action="store_true", help="the script is an executable")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank")
    p.add_argument("--no_ssh", action="store_true", help="start only this node")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the ssh check")
    p.add_argument("--force_multi", action="store_true", help="multi-node mode on one host")
    p.add_argument("--save_pid", action="store_true", help="write the launcher pid file")
    p.add_argument("--enable_each_rank_log", type=str, default="None", help="per-rank log dir")
    p.add_argument("--autotuning", type=str, default="", choices=["tune", "run"])
    p.add_argument("user_script", type=str, help="training script, then its arguments")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    p.add_argument("--bind_cores_to_rank", action="store_true", help="bind ranks to cores")
    p.add_argument("--bind_core_list", type=str, default=None, help="cores, e.g. 1,3-5,7")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port of the remote nodes")
    p.add_argument("--venv_script", type=str, default=None, help="activation script to source")
    p.add_argument(
        "--log_level",
        type=str,
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
    )
    p.add_argument("-q", "--quiet", action="store_true", help="same as --log_level error")
    return p.parse_args(args=None if args is None else list(args))


def fetch_hostfile(hostfile_path: str) -> OrderedDict[str, int] | None:
    """``{host: num_slots}`` from a ``host slots=N`` hostfile; None (with a warning) if missing.

    Raises:
        ValueError: a malformed line, a duplicate host or no hosts at all.
    """
    if not os.path.isfile(hostfile_path):
        logger.warning("hostfile %s not found; training on local resources only.", hostfile_path)
        return None
    return OrderedDict(read_hostfile(hostfile_path))


def parse_resource_filter(
    host_info: Mapping[str, Sequence[int]], include_str: str = "", exclude_str: str = ""
) -> OrderedDict[str, list[int]]:
    """Filter ``{host: [slot, ...]}`` with ``NAME[:SLOT[,SLOT]]@NAME...`` strings.

    ``include_str="worker-0@worker-1:0,2"`` keeps all of worker-0 and slots 0 and 2 of
    worker-1; ``exclude_str="worker-1:0"`` keeps everything but slot 0 of worker-1. Host
    order follows ``host_info``; hosts left without slots are dropped.

    Raises:
        ValueError: both strings given, an unknown host or slot, or nothing left.
    """
    pool: ResourcePool = {host: list(slots) for host, slots in host_info.items()}
    return OrderedDict(select_resources(pool, include_str, exclude_str))


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str, exclusion: str
) -> OrderedDict[str, list[int]]:
    """:func:`parse_resource_filter` on ``{host: num_slots}`` (slots ``0..num_slots-1``)."""
    return parse_resource_filter(pool_from_hostfile(dict(resource_pool)), inclusion, exclusion)


def apply_num_nodes_and_gpus(
    active_resources: Mapping[str, Sequence[int]], num_nodes: int, num_gpus: int
) -> OrderedDict[str, list[int]]:
    """Keep the first ``num_nodes`` hosts and the first ``num_gpus`` slots of each (-1: all).

    Raises:
        ValueError: more nodes or slots asked for than there are.
    """
    pool: ResourcePool = {host: list(slots) for host, slots in active_resources.items()}
    return OrderedDict(limit_resources(pool, num_nodes=num_nodes, num_gpus=num_gpus))


if __name__ == "__main__":
    sys.exit(main())
