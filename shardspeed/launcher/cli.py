"""``shardspeed``: the launcher command and its subcommands.

``shardspeed [launcher options] script.py [script args]`` launches a training script on
one or more nodes (see :mod:`shardspeed.launcher.plan`); ``shardspeed <subcommand> ...``
runs a tool. The first token decides: a name in :data:`SUBCOMMANDS` is a subcommand,
anything else is the launcher. Subcommands live in their own modules and are imported
only when used; adding one means writing ``shardspeed/launcher/<name>_cmd.py`` with
``main(argv: list[str]) -> int`` and listing it here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from shardspeed.launcher.commands import format_command
from shardspeed.launcher.elastic import DEFAULT_MAX_RESTARTS, ElasticOptions
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.plan import DEFAULT_HOSTFILE, LaunchOptions, build_plan, resolve_pool

# name -> (module, function); function signature: main(argv: list[str]) -> int
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "report": ("shardspeed.launcher.report", "main"),
    "serve": ("shardspeed.launcher.serve_cmd", "main"),
    "estimate": ("shardspeed.launcher.estimate_cmd", "main"),
    "checkpoint": ("shardspeed.launcher.checkpoint_cmd", "main"),
}

_USAGE = (
    "shardspeed [launcher options] SCRIPT [SCRIPT ARGS...]\n"
    f"       shardspeed {{{','.join(SUBCOMMANDS)}}} [ARGS...]"
)
_EPILOG = (
    "subcommands: report (environment table), serve, estimate, checkpoint "
    "(run 'shardspeed NAME --help'). Multi-node: every node runs torchrun with a static "
    "rendezvous at --master_addr:--master_port; node rank = hostfile order. "
    "See docs/launcher.md."
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardspeed`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return run_subcommand(args[0], args[1:])
    try:
        return launch(args)
    except LauncherError as err:
        print(f"shardspeed: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2


def run_subcommand(name: str, argv: list[str]) -> int:
    """Import the subcommand's module lazily and call its ``main(argv)``."""
    module_name, function_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            print(
                f"shardspeed: error: subcommand {name!r} is not available in this build "
                f"(module {module_name} is missing).",
                file=sys.stderr,
            )
        else:
            print(
                f"shardspeed: error: subcommand {name!r} needs the package {err.name!r}, "
                "which is not installed; install it and retry.",
                file=sys.stderr,
            )
        return 2
    function: Callable[[list[str]], int] | None = getattr(module, function_name, None)
    if function is None:
        print(
            f"shardspeed: error: {module_name} has no {function_name}() entry point.",
            file=sys.stderr,
        )
        return 2
    try:
        return int(function(argv) or 0)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (DeepSpeed's flag names, plus ``--nproc``)."""
    p = argparse.ArgumentParser(prog="shardspeed", usage=_USAGE, epilog=_EPILOG)
    p.add_argument(
        "--num_gpus",
        "--num_accelerators",
        "--nproc",
        "--nproc_per_node",
        dest="num_gpus",
        metavar="N",
        type=int,
        default=-1,
        help="processes (devices) per node; default: all visible GPUs, or 1 on a CPU machine",
    )
    p.add_argument(
        "--num_nodes", type=int, default=-1, metavar="K", help="use the first N hostfile hosts"
    )
    p.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help="MPI-style hostfile ('host slots=N' lines); default /job/hostfile if it exists, "
        "else this machine only",
    )
    p.add_argument("-i", "--include", default="", help="NAME[:SLOT[,SLOT]]@NAME... to use")
    p.add_argument("-e", "--exclude", default="", help="NAME[:SLOT[,SLOT]]@NAME... to skip")
    p.add_argument("--master_addr", default="", help="default: 127.0.0.1, or the first host")
    p.add_argument("--master_port", type=int, default=29500, help="default 29500")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank (--no_ssh)")
    p.add_argument("--no_ssh", action="store_true", help="start only this node (run once per node)")
    p.add_argument(
        "--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script"
    )
    p.add_argument("--no_python", action="store_true", help="SCRIPT is an executable")
    p.add_argument("--module", action="store_true", help="SCRIPT is a module (python -m)")
    p.add_argument(
        "--launcher",
        choices=("ssh", "pdsh"),
        default="ssh",
        help="how remote nodes are reached (default ssh)",
    )
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port of the remote nodes")
    p.add_argument("--dry_run", action="store_true", help="print each node's command and exit")
    p.add_argument(
        "--log_level",
        choices=("debug", "info", "warning", "error", "critical"),
        default=None,
        help="launcher log level; also exported as SHARDSPEED_LOG_LEVEL to every rank",
    )
    p.add_argument(
        "--enable_each_rank_log",
        metavar="DIR",
        default=None,
        help="also write each rank's stdout/stderr to files under DIR",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="torchrun's elastic agent with a c10d rendezvous on the first host: hosts may "
        "leave and join between --min_nodes and --max_nodes (docs/distributed.md)",
    )
    p.add_argument("--min_nodes", type=int, default=None, help="--elastic: fewest hosts")
    p.add_argument("--max_nodes", type=int, default=None, help="--elastic: most hosts")
    p.add_argument(
        "--max_restarts",
        type=int,
        default=None,
        help=f"--elastic: worker restarts per agent (default {DEFAULT_MAX_RESTARTS})",
    )
    p.add_argument("--rdzv_id", default="", help="--elastic: job id (default: from the pid)")
    p.add_argument(
        "--rdzv_conf", default="", help="--elastic: extra KEY=VALUE,... for the rendezvous"
    )
    p.add_argument("--version", action="store_true", help="print the shardspeed version")
    p.add_argument(
        "user_script", nargs="?", metavar="SCRIPT", help="training script (or module, executable)"
    )
    p.add_argument(
        "user_args", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS", help="passed to SCRIPT"
    )
    return p


def parse_options(argv: list[str]) -> tuple[argparse.Namespace, LaunchOptions | None]:
    """Parse and validate launcher flags into ``(namespace, options)`` (None: ``--version``)."""
    args = build_parser().parse_args(argv)
    if args.version:
        return args, None
    if not args.user_script:
        raise LauncherError(
            "missing the training script; usage: shardspeed [launcher options] script.py "
            "[script args]."
        )
    if args.module and args.no_python:
        raise LauncherError("--module and --no_python are mutually exclusive; pick one.")
    for flag, port in (("--master_port", args.master_port), ("--ssh_port", args.ssh_port)):
        if port is not None and not 0 < port < 65536:
            raise LauncherError(f"{flag} must be in 1..65535, got {port}.")
    elastic = _elastic_options(args)
    script = args.user_script
    if not args.module:
        found = Path(script).is_file() or (args.no_python and shutil.which(script))
        if not found:
            raise LauncherError(
                f"script {script!r} not found (working directory {os.getcwd()}); pass a "
                "path to a Python file, --module for a module name, or --no_python for an "
                "executable."
            )
    opts = LaunchOptions(
        user_script=script,
        user_args=tuple(args.user_args),
        num_gpus=args.num_gpus,
        num_nodes=args.num_nodes,
        hostfile=args.hostfile,
        include=args.include,
        exclude=args.exclude,
        master_addr=args.master_addr,
        master_port=args.master_port,
        node_rank=args.node_rank,
        no_ssh=args.no_ssh,
        no_local_rank=args.no_local_rank,
        no_python=args.no_python,
        module=args.module,
        launcher=args.launcher,
        ssh_port=args.ssh_port,
        log_dir=args.enable_each_rank_log,
        log_level=args.log_level,
        dry_run=args.dry_run,
        elastic=elastic,
    )
    return args, opts


def _elastic_options(args: argparse.Namespace) -> ElasticOptions | None:
    """The elastic flags as options; they need ``--elastic`` (and it needs none of them)."""
    given = [
        flag
        for flag, value in (
            ("--min_nodes", args.min_nodes),
            ("--max_nodes", args.max_nodes),
            ("--max_restarts", args.max_restarts),
            ("--rdzv_id", args.rdzv_id or None),
            ("--rdzv_conf", args.rdzv_conf or None),
        )
        if value is not None
    ]
    if not args.elastic:
        if given:
            raise LauncherError(f"{', '.join(given)} only apply with --elastic; add --elastic.")
        return None
    if args.no_ssh and not args.rdzv_id:
        raise LauncherError(
            "--elastic --no_ssh starts one node per call, so the nodes only meet with a "
            "shared job id: pass the same --rdzv_id on every node."
        )
    hosts = args.num_nodes if args.num_nodes > 0 else None
    min_nodes = args.min_nodes if args.min_nodes is not None else 1
    max_nodes = args.max_nodes if args.max_nodes is not None else (hosts or min_nodes)
    if args.max_nodes is None and hosts is None:
        max_nodes = max(min_nodes, _hostfile_size(args))
    return ElasticOptions(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        max_restarts=DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
    )


def _hostfile_size(args: argparse.Namespace) -> int:
    """Hosts in the hostfile (1 without one): the default ``--max_nodes``."""
    from shardspeed.launcher.hostfile import read_hostfile

    path = args.hostfile or (DEFAULT_HOSTFILE if Path(DEFAULT_HOSTFILE).is_file() else None)
    return len(read_hostfile(path)) if path else 1


def launch(argv: list[str]) -> int:
    """The launcher: plan the per-node commands, then print (``--dry_run``) or run them."""
    from shardspeed.launcher.process import run_local, run_remote
    from shardspeed.utils.logging import get_logger

    _, opts = parse_options(argv)
    if opts is None:
        import shardspeed

        print(f"shardspeed {shardspeed.__version__}")
        return 0
    logger = get_logger("shardspeed.launcher")
    if opts.log_level:
        logging.getLogger("shardspeed").setLevel(opts.log_level.upper())
    resolved = resolve_pool(opts, os.environ)
    nodes = build_plan(opts, resolved, os.environ, Path.cwd(), Path.home())
    if opts.dry_run:
        for node in nodes:
            print(format_command(node.argv, node.env))
        return 0
    for node in nodes:
        logger.info(
            "node %d (%s): %s", node.node_rank, node.host, format_command(node.argv, node.env)
        )
    if len(nodes) == 1 and not nodes[0].remote:
        return run_local(nodes[0].argv, nodes[0].env)
    commands = [(node.host, node.argv, node.env) for node in nodes]
    return run_remote(
        commands, prefix_output=opts.launcher == "ssh", elastic=opts.elastic is not None
    )


if __name__ == "__main__":
    sys.exit(main())
