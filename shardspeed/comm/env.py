"""Discover this process's place in the job from launcher environment variables.

Pure functions of an environment mapping (no ``os.environ`` access), so every launcher's
convention is unit-tested. Sources, first match wins:

1. torchrun / ``shardspeed`` launcher / torch.distributed env:// (``RANK``, ``WORLD_SIZE``,
   ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
2. Open MPI (``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` / ``_LOCAL_SIZE``).
3. MPICH / Intel MPI / PMI (``PMI_RANK``, ``PMI_SIZE``, local rank from ``MPI_LOCALRANKID``
   or ``PALS_LOCAL_RANKID``).
4. Slurm ``srun`` steps (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``,
   ``SLURM_LOCALID``; the master is ``SLURM_LAUNCH_NODE_IPADDR`` or the first host of
   ``SLURM_JOB_NODELIST``). Only inside a step (``SLURM_STEP_ID`` set): a bare ``sbatch``
   script has ``SLURM_NTASKS`` but is a single process.
5. Nothing: a single process (world of 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as read from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str | None  # None: the launcher did not say (e.g. multi-node MPI)
    master_port: int
    source: str  # "torchrun" | "mpi" | "pmi" | "slurm" | "none"

    @property
    def is_multi_process(self) -> bool:
        return self.world_size > 1


def _int(environ: Mapping[str, str], key: str) -> int:
    raw = environ[key]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {key}={raw!r} is not an integer; the launcher must set "
            "it to a whole number (unset it to run as a single process)."
        ) from None


def _opt_int(environ: Mapping[str, str], *keys: str) -> int | None:
    for key in keys:
        if key in environ and environ[key] != "":
            return _int(environ, key)
    return None


def _leading_int(raw: str | None) -> int | None:
    """``"4"`` or ``"4(x2)"`` (Slurm's compressed per-node counts) -> 4; else None."""
    match = re.match(r"\d+", raw or "")
    return int(match.group(0)) if match else None


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match or not match.group(1):
        raise ValueError(
            f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm host list; set MASTER_ADDR to "
            "the first node's address."
        )
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _master(environ: Mapping[str, str], fallback_addr: str | None, port: int) -> tuple:
    addr = environ.get("MASTER_ADDR") or fallback_addr
    master_port = _opt_int(environ, "MASTER_PORT")
    return addr, port if master_port is None else master_port


def _check(env: DistEnv) -> DistEnv:
    if env.world_size < 1:
        raise ValueError(
            f"world size from {env.source} is {env.world_size}; it must be >= 1 (check the "
            "launcher's WORLD_SIZE / task count)."
        )
    if not 0 <= env.rank < env.world_size:
        raise ValueError(
            f"rank {env.rank} from {env.source} is outside [0, {env.world_size}); the "
            "launcher's rank and world-size variables disagree."
        )
    if env.local_rank < 0:
        raise ValueError(f"local rank {env.local_rank} from {env.source} must be >= 0.")
    return env


def discover_env(
    environ: Mapping[str, str], default_port: int = DEFAULT_PORT, use_mpi: bool = True
) -> DistEnv:
    """Read rank, world size, local rank and master address from ``environ``.

    ``use_mpi=False`` ignores MPI/PMI variables (``init_distributed(auto_mpi_discovery=False)``).
    For a multi-node MPI job without ``MASTER_ADDR`` the address is ``None``; a single-node
    one (local size == world size) uses ``127.0.0.1``.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        addr, port = _master(environ, "127.0.0.1", default_port)
        return _check(
            DistEnv(
                rank=_int(environ, "RANK"),
                world_size=_int(environ, "WORLD_SIZE"),
                local_rank=_opt_int(environ, "LOCAL_RANK") or 0,
                local_world_size=_opt_int(environ, "LOCAL_WORLD_SIZE"),
                master_addr=addr,
                master_port=port,
                source="torchrun",
            )
        )
    if use_mpi and "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        world = _int(environ, "OMPI_COMM_WORLD_SIZE")
        local_size = _opt_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
        addr, port = _master(environ, "127.0.0.1" if local_size == world else None, default_port)
        return _check(
            DistEnv(
                rank=_int(environ, "OMPI_COMM_WORLD_RANK"),
                world_size=world,
                local_rank=_opt_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
                local_world_size=local_size,
                master_addr=addr,
                master_port=port,
                source="mpi",
            )
        )
    if use_mpi and "PMI_RANK" in environ and "PMI_SIZE" in environ:
        world = _int(environ, "PMI_SIZE")
        local_size = _opt_int(environ, "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE")
        addr, port = _master(environ, "127.0.0.1" if local_size == world else None, default_port)
        return _check(
            DistEnv(
                rank=_int(environ, "PMI_RANK"),
                world_size=world,
                local_rank=_opt_int(environ, "MPI_LOCALRANKID", "PALS_LOCAL_RANKID") or 0,
                local_world_size=local_size,
                master_addr=addr,
                master_port=port,
                source="pmi",
            )
        )
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        world = _opt_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        if world is not None:
            fallback = environ.get("SLURM_LAUNCH_NODE_IPADDR") or None
            if fallback is None and environ.get("SLURM_JOB_NODELIST"):
                fallback = first_host(environ["SLURM_JOB_NODELIST"])
            addr, port = _master(environ, fallback, default_port)
            return _check(
                DistEnv(
                    rank=_int(environ, "SLURM_PROCID"),
                    world_size=world,
                    local_rank=_opt_int(environ, "SLURM_LOCALID") or 0,
                    local_world_size=_leading_int(environ.get("SLURM_NTASKS_PER_NODE")),
                    master_addr=addr,
                    master_port=port,
                    source="slurm",
                )
            )
    addr, port = _master(environ, "127.0.0.1", default_port)
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=_opt_int(environ, "LOCAL_RANK") or 0,
        local_world_size=1,
        master_addr=addr,
        master_port=port,
        source="none",
    )
