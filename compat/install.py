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
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
        if builds_wheels_here():  # offline-safe: this environment's setuptools builds it
            cmd.append("--no-build-isolation")
        else:
            sys.stderr.write(
                "compat: this environment's setuptools cannot build wheels (needs >= 70.1, or "
                "the `wheel` package); building in an isolated environment, which downloads "
                "setuptools. Offline, `pip install 'setuptools>=70.1'` first.\n"
            )
        cmd += ["--upgrade", "--target", args.target] if args.target else []
        return subprocess.call([*cmd, str(source)])


def builds_wheels_here() -> bool:
    """Whether ``pip install --no-build-isolation`` can build the shim here: setuptools >=
    70.1 has ``bdist_wheel`` built in; older ones need the ``wheel`` package."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    if tuple(parts + [0] * (2 - len(parts))) >= (70, 1):
        return True
    try:
        importlib.metadata.version("wheel")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
