"""Worker entry that prepends ``--local_rank=<LOCAL_RANK>`` to the user's arguments.

torchrun only sets the ``LOCAL_RANK`` variable; DeepSpeed scripts also expect the
argument. torchrun starts ``python -m shardspeed.launcher.local_rank_shim [--module |
--no-python] -- TARGET ARGS...`` and this module replaces itself (``exec``, same pid, so
torchrun's signals reach the user's process) with one of::

    python -u TARGET --local_rank=N ARGS...      # default: a script path
    python -u -m TARGET --local_rank=N ARGS...   # --module
    TARGET --local_rank=N ARGS...                # --no-python: an executable
"""

from __future__ import annotations

import os
import sys


def shim_argv(argv: list[str], local_rank: str, python: str | None = None) -> list[str]:
    """The argv to exec for shim arguments ``argv`` (without the program name)."""
    mode = "python"
    rest = list(argv)
    while rest and rest[0] in ("--module", "--no-python"):
        mode = rest.pop(0)
    if rest and rest[0] == "--":
        rest.pop(0)
    if not rest:
        raise ValueError(
            "local_rank_shim: missing TARGET; usage: python -m "
            "shardspeed.launcher.local_rank_shim [--module|--no-python] -- TARGET [ARGS...]"
        )
    target, user_args = rest[0], rest[1:]
    flag = f"--local_rank={local_rank}"
    python = python or sys.executable
    if mode == "--module":
        return [python, "-u", "-m", target, flag, *user_args]
    if mode == "--no-python":
        return [target, flag, *user_args]
    return [python, "-u", target, flag, *user_args]


def main(argv: list[str] | None = None) -> int:
    """Exec the user's program with ``--local_rank`` prepended; returns only on error."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        sys.stderr.write(
            "local_rank_shim: LOCAL_RANK is not set; this entry is meant to be started by "
            "torchrun (via the shardspeed launcher).\n"
        )
        return 2
    try:
        exec_argv = shim_argv(sys.argv[1:] if argv is None else argv, local_rank)
    except ValueError as err:
        sys.stderr.write(f"{err}\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(exec_argv[0], exec_argv)
    except OSError as err:
        sys.stderr.write(f"local_rank_shim: cannot run {exec_argv[0]!r}: {err}\n")
        return 127
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
