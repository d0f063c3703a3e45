"""Install the compatibility distribution ``compat/deepspeed`` (``make compat``).

Refuses when a real DeepSpeed is installed in the target environment: the shim would
replace it, and a script that wants DeepSpeed should get DeepSpeed. A previous shim
(``+shardspeed`` version) is replaced.

    python compat/install.py [--target DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "deepspeed"


def installed_deepspeed(path: list[str] | None = None) -> str | None:
    """Version of the ``deepspeed`` distribution on ``path`` (default: sys.path), or None."""
    for dist in importlib.metadata.distributions(path=path or sys.path):
        if (dist.metadata["Name"] or "").lower() == "deepspeed":
            return dist.version
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="install into this directory instead (tests)")
    args = parser.parse_args(argv)
    found = installed_deepspeed([args.target] if args.target else None)
    if found is not None and "+shardspeed" not in found:
        sys.stderr.write(
            f"compat: DeepSpeed {found} is installed in this environment; refusing to replace "
            "it with the shardspeed shim. Fix: `pip uninstall deepspeed` first, or install the "
            "shim into another virtual environment.\n"
        )
        return 1
    with tempfile.TemporaryDirectory() as tmp:  # build out of tree: no build/ in the repo
        source = Path(tmp) / "deepspeed"
        shutil.copytree(SOURCE, source)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        cmd += ["--upgrade", "--target", args.target] if args.target else []
        return subprocess.call([*cmd, str(source)])


if __name__ == "__main__":
    sys.exit(main())
