"""DeepSpeed's ``deepspeed.launcher.runner``: the ``deepspeed`` command's entry point.

``main`` is ShardSpeed's launcher (:func:`shardspeed.launcher.cli.main`), which takes
DeepSpeed's launcher options (``--num_gpus``, ``--num_nodes``, ``--hostfile``,
``--include``/``--exclude``, ``--master_addr``/``--master_port``, ``--no_local_rank``, ...)
and passes ``--local_rank=N`` to the script as DeepSpeed does. The compatibility
distribution installs a ``deepspeed`` console command pointing here.
"""

from __future__ import annotations

import sys

from shardspeed.launcher.cli import main as _launcher_main

__all__ = ["main"]


def main(args: list[str] | None = None) -> int:
    """Run the launcher on ``args`` (default: ``sys.argv[1:]``); returns the exit status."""
    return _launcher_main(sys.argv[1:] if args is None else list(args))


if __name__ == "__main__":
    sys.exit(main())
