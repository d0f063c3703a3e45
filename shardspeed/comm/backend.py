"""Process-group lifecycle: ``init_distributed``, groups, ranks.

One timeout is chosen at initialisation and applied to every group made through
:func:`new_group`, so a hang surfaces at the same time whichever group it happens in.
It is, first match wins: ``init_distributed(timeout=...)``, the environment variable
``SHARDSPEED_COMM_TIMEOUT`` (seconds), DeepSpeed's ``DEEPSPEED_TIMEOUT`` (minutes), and
:data:`DEFAULT_TIMEOUT` (30 minutes).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.accelerator import get_accelerator
from shardspeed.comm import teardown
from shardspeed.comm.env import DEFAULT_PORT, DistEnv, discover_env
from shardspeed.utils.logging import get_logger, log_dist

logger = get_logger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=30)
TIMEOUT_ENV = "SHARDSPEED_COMM_TIMEOUT"  # seconds
DEEPSPEED_TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"  # minutes (DeepSpeed's variable)
# Joining the world (store connection, gloo/NCCL mesh set-up) waits at least this long for
# late ranks, however short the collective timeout: ranks of one job start seconds apart.
RENDEZVOUS_TIMEOUT_ENV = "SHARDSPEED_RENDEZVOUS_TIMEOUT"  # seconds
MIN_RENDEZVOUS_TIMEOUT = timedelta(minutes=5)


@dataclass
class _CommState:
    timeout: timedelta | None = None  # None: not initialised by init_distributed
    local_rank: int | None = None
    env: DistEnv | None = None


_STATE = _CommState()
_GROUP_TIMEOUTS: weakref.WeakKeyDictionary[Any, timedelta] = weakref.WeakKeyDictionary()


def resolve_timeout(timeout: timedelta | None, environ: Mapping[str, str]) -> timedelta:
    """The process-group timeout: ``timeout`` if given, else the environment, else 30 min."""
    if timeout is not None:
        if not isinstance(timeout, timedelta):
            raise ValueError(
                f"init_distributed(timeout={timeout!r}) must be a datetime.timedelta, "
                "e.g. timedelta(minutes=30)."
            )
        return timeout
    for name, unit in ((TIMEOUT_ENV, "seconds"), (DEEPSPEED_TIMEOUT_ENV, "minutes")):
        found = _env_duration(
            environ, name, unit, "the process-group timeout", "the default of 30 minutes"
        )
        if found is not None:
            return found
    return DEFAULT_TIMEOUT


def resolve_rendezvous_timeout(timeout: timedelta, environ: Mapping[str, str]) -> timedelta:
    """How long joining the world may wait for late ranks: the environment's
    ``SHARDSPEED_RENDEZVOUS_TIMEOUT`` seconds, else the longer of ``timeout`` (the collective
    timeout) and 5 minutes."""
    found = _env_duration(
        environ,
        RENDEZVOUS_TIMEOUT_ENV,
        "seconds",
        "how long joining the job waits for late ranks",
        "the default, the longer of the collective timeout and 5 minutes",
    )
    return found if found is not None else max(timeout, MIN_RENDEZVOUS_TIMEOUT)


def _env_duration(
    environ: Mapping[str, str], name: str, unit: str, meaning: str, default: str
) -> timedelta | None:
    """The positive duration in ``environ[name]`` (``unit``: seconds or minutes); None when
    unset; a ValueError naming the variable, its value, ``meaning`` and ``default`` else."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"environment variable {name}={text!r} must be a positive number of {unit} "
            f"({meaning}); unset it for {default}."
        )
    return timedelta(seconds=value) if unit == "seconds" else timedelta(minutes=value)


def group_timeout(group: Any) -> timedelta | None:
    """The timeout ``group`` was created with, when this module created it (else None)."""
    if group is None or group is dist.GroupMember.WORLD:
        return _STATE.timeout
    try:
        return _GROUP_TIMEOUTS.get(group)
    except TypeError:
        return None


def _resolve_master_addr(env: DistEnv) -> str:
    if env.master_addr:
        return env.master_addr
    try:  # multi-node MPI without MASTER_ADDR: ask rank 0 for its hostname
        import socket

        from mpi4py import MPI  # type: ignore[import-not-found]

        return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)
    except ImportError:
        raise ValueError(
            f"launched by {env.source} across nodes (world size {env.world_size}) but "
            "MASTER_ADDR is not set; export MASTER_ADDR=<first node's address> (and "
            "MASTER_PORT) or install mpi4py so rank 0's hostname can be broadcast."
        ) from None


def _export_env(env: DistEnv, addr: str) -> None:
    """Make the discovered values visible to code that reads torchrun's variables."""
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    if env.local_world_size is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise ``torch.distributed`` from the launcher's environment (no-op if done).

    Reads torchrun, Open MPI, PMI and Slurm variables (see :mod:`shardspeed.comm.env`);
    ``rank``/``world_size`` >= 0 override them. The backend defaults to ``nccl`` with CUDA
    and ``gloo`` otherwise; with CUDA the device is set from the local rank. A process with
    no launcher variables becomes a world of one. ``timeout`` (default: the environment's
    ``SHARDSPEED_COMM_TIMEOUT`` seconds or ``DEEPSPEED_TIMEOUT`` minutes, else 30 minutes)
    is the world group's and every :func:`new_group`'s: a collective that waits longer
    raises :class:`~shardspeed.comm.errors.CollectiveTimeoutError` with this rank's report
    (gloo; NCCL with ``TORCH_NCCL_BLOCKING_WAIT=1``). ``dist_init_required=False`` skips
    initialisation.
    ``config`` (a ds_config dict or object) configures the comms logger.
    """
    if config is not None:
        from shardspeed.comm.logger import configure

        configure(config)
    if dist.is_initialized():
        teardown.install()  # a group the caller made: still torn down in order at exit
        return
    if dist_init_required is False:
        return
    timeout = resolve_timeout(timeout, os.environ)
    env = discover_env(os.environ, default_port=distributed_port, use_mpi=auto_mpi_discovery)
    if rank >= 0 or world_size >= 0:
        if rank < 0 or world_size < 1 or rank >= world_size:
            raise ValueError(
                f"init_distributed(rank={rank}, world_size={world_size}): pass both, with "
                "0 <= rank < world_size (or neither, to read them from the environment)."
            )
        env = DistEnv(
            rank, world_size, env.local_rank, env.local_world_size, env.master_addr,
            env.master_port, "arguments",
        )  # fmt: skip
    backend = dist_backend or get_accelerator().communication_backend_name()
    _STATE.timeout, _STATE.local_rank, _STATE.env = timeout, env.local_rank, env
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())

    if env.source == "none" and init_method is None:
        # Single process, no launcher: an in-memory store, no ports to collide on.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        addr = _resolve_master_addr(env)
        _export_env(env, addr)
        # joining waits for late ranks longer than a (short) collective timeout allows
        rendezvous = resolve_rendezvous_timeout(timeout, os.environ)
        dist.init_process_group(
            backend,
            init_method=init_method or f"tcp://{addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=rendezvous,
        )
        if rendezvous != timeout:
            _set_collective_timeout(timeout)
        from shardspeed.comm.blame import install  # failure records for blame reports

        install()
    teardown.install()
    if verbose:
        log_dist(
            f"initialised torch.distributed: backend={backend}, world_size={env.world_size}, "
            f"source={env.source}, timeout={timeout}"
        )


def _set_collective_timeout(timeout: timedelta) -> None:
    """Give the world group's backend ``timeout`` for its collectives (after joining)."""
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout, dist.group.WORLD)


def is_initialized() -> bool:
    """True once the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """Rank in ``group`` (default: world); 0 when not initialised."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """Size of ``group`` (default: world); 1 when not initialised."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """Rank within this node (from the launcher; 0 for a single process)."""
    if _STATE.local_rank is not None:
        return _STATE.local_rank
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """Global rank of ``group_rank`` in ``group`` (world group: identity)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    """The default (world) process group."""
    return dist.group.WORLD


def get_timeout() -> timedelta:
    """The timeout every group is created with (see :func:`resolve_timeout`)."""
    return _STATE.timeout or resolve_timeout(None, os.environ)


def new_group(
    ranks: list[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    **kwargs: Any,
) -> Any:
    """``torch.distributed.new_group`` with the stored timeout as the default.

    Like torch, every rank of the world must call this in the same order with the same
    ``ranks`` (ranks not in the group get a non-member handle).
    """
    timeout = timeout or get_timeout()
    group = dist.new_group(ranks=ranks, timeout=timeout, backend=backend, **kwargs)
    try:
        _GROUP_TIMEOUTS[group] = timeout  # named in timeout reports
    except TypeError:  # a non-member placeholder that takes no weak references
        pass
    return group


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group`` (default: every group and the world; resets stored state)."""
    if not is_initialized():
        return
    dist.destroy_process_group(group)
    if group is None:
        from shardspeed.comm.logger import forget_groups

        reset_state()
        forget_groups()


def reset_state() -> None:
    """Forget the stored timeout and local rank (after the world is destroyed)."""
    _STATE.timeout, _STATE.local_rank, _STATE.env = None, None, None
    _GROUP_TIMEOUTS.clear()
