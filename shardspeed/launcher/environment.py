"""Which environment variables travel to remote nodes (pure functions).

A multi-node launch exports, on every remote node, the launcher's variables whose names
start with one of :data:`PROPAGATED_PREFIXES`, then the ``VAR=VAL`` lines of the env
files (``.deepspeed_env`` and ``.shardspeed_env``, first in ``~`` then in the working
directory; later files win). ``SHARDSPEED_ENV_FILE`` (or DeepSpeed's ``DS_ENV_FILE``)
replaces the list of file names with one name. A local, single-node launch inherits the
launcher's environment as is and reads no env file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from shardspeed.launcher.errors import LauncherError

PROPAGATED_PREFIXES: tuple[str, ...] = ("NCCL_", "PYTHON", "MV2_", "UCX_", "SHARDSPEED_")
ENV_FILE_NAMES: tuple[str, ...] = (".deepspeed_env", ".shardspeed_env")

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def propagated_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` whose names start with a propagated prefix (sorted)."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(PROPAGATED_PREFIXES)
    }


def parse_env_file(text: str, source: str = "env file") -> dict[str, str]:
    """Parse ``VAR=VAL`` lines (``#`` comments, blank lines and ``export`` allowed).

    A value wrapped in matching single or double quotes loses them. A line without ``=``
    or with an invalid variable name is a :class:`LauncherError` naming the line.
    """
    values: dict[str, str] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not _NAME_RE.match(name):
            raise LauncherError(
                f"{source} line {line_no}: expected 'VAR=VALUE', got {raw.strip()!r}."
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[name] = value
    return values


def env_file_names(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The env file names to look for (an override variable replaces the defaults)."""
    override = environ.get("SHARDSPEED_ENV_FILE") or environ.get("DS_ENV_FILE")
    return (override,) if override else ENV_FILE_NAMES


def find_env_files(cwd: Path, home: Path, names: tuple[str, ...] = ENV_FILE_NAMES) -> list[Path]:
    """Existing env files, home directory first then ``cwd`` (so ``cwd`` wins on conflicts)."""
    found: list[Path] = []
    for folder in (home, cwd):
        for name in names:
            path = folder / name
            if path.is_file() and path.resolve() not in {p.resolve() for p in found}:
                found.append(path)
    return found


def remote_env(environ: Mapping[str, str], cwd: Path, home: Path) -> dict[str, str]:
    """Everything a remote node must export: propagated variables, then env-file lines."""
    env = propagated_env(environ)
    for path in find_env_files(cwd, home, env_file_names(environ)):
        env.update(parse_env_file(path.read_text(), source=f"env file {str(path)!r}"))
    return env
