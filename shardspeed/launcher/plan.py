"""From launcher options to the exact command each node runs.

:func:`resolve_pool` finds the resources (hostfile, or the local machine) and applies the
selection flags; :func:`build_plan` turns them into one :class:`NodeCommand` per node.
Nothing here starts a process, so ``--dry_run`` and the unit tests see exactly what a
real launch would run.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardspeed.launcher.commands import (
    build_pdsh_argv,
    build_remote_command,
    build_ssh_argv,
    build_torchrun_argv,
)
from shardspeed.launcher.elastic import (
    ELASTIC_ENV,
    ElasticOptions,
    default_rdzv_id,
    rendezvous_argv,
)
from shardspeed.launcher.environment import remote_env
from shardspeed.launcher.errors import LauncherError
from shardspeed.launcher.hostfile import (
    ResourcePool,
    limit_resources,
    pool_from_hostfile,
    read_hostfile,
    select_resources,
)

DEFAULT_HOSTFILE = "/job/hostfile"
LOCAL_HOST = "localhost"
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class LaunchOptions:
    """The launcher flags (names and defaults match the ``shardspeed`` command line)."""

    user_script: str
    user_args: tuple[str, ...] = ()
    num_gpus: int = -1
    num_nodes: int = -1
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    master_addr: str = ""
    master_port: int = 29500
    node_rank: int = -1
    no_ssh: bool = False
    no_local_rank: bool = False
    no_python: bool = False
    module: bool = False
    launcher: str = "ssh"
    ssh_port: int | None = None
    log_dir: str | None = None
    log_level: str | None = None
    dry_run: bool = False
    elastic: ElasticOptions | None = None  # --elastic: torchrun's c10d rendezvous


@dataclass(frozen=True)
class NodeCommand:
    """What one node runs: ``argv`` started locally with ``env`` added to our environment.

    For a local node ``argv`` is the torchrun argv; for a remote node it is the ssh/pdsh
    argv wrapping ``torchrun_argv`` (whose exported variables are inside the command).
    """

    host: str
    node_rank: int
    slots: tuple[int, ...]
    torchrun_argv: list[str]
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    remote: bool = False


@dataclass(frozen=True)
class ResolvedPool:
    """The selected resources plus what selection started from."""

    pool: ResourcePool  # after --include/--exclude/--num_nodes/--num_gpus
    full_pool: ResourcePool  # before selection
    from_hostfile: bool
    gpu: bool  # slots are device ids (hostfile hosts, or local CUDA devices)


def cuda_device_count(environ: Mapping[str, str]) -> int:
    """Visible CUDA devices on this machine (0 without torch/CUDA or when forced to CPU)."""
    if environ.get("SHARDSPEED_ACCELERATOR", environ.get("DS_ACCELERATOR", "")) == "cpu":
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # pragma: no cover - broken torch install
        return 0


def local_slots(environ: Mapping[str, str], num_gpus: int, device_count: int) -> list[int]:
    """Slots of the local machine: device ids on GPU, else ``num_gpus`` (default 1) processes.

    A user-set ``CUDA_VISIBLE_DEVICES`` of integer ids is honoured: its ids are the slots.
    """
    if device_count <= 0:
        return list(range(num_gpus if num_gpus > 0 else 1))
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [s.strip() for s in visible.split(",") if s.strip()]
    if len(ids) == device_count and all(s.isdigit() for s in ids):
        return [int(s) for s in ids]
    return list(range(device_count))


def resolve_pool(
    opts: LaunchOptions, environ: Mapping[str, str], device_count: int | None = None
) -> ResolvedPool:
    """Read the hostfile (or probe the local machine) and apply the selection flags."""
    hostfile = opts.hostfile
    if hostfile is None and Path(DEFAULT_HOSTFILE).is_file():
        hostfile = DEFAULT_HOSTFILE
    if hostfile is not None:
        full_pool = pool_from_hostfile(read_hostfile(hostfile))
        gpu = True
    else:
        count = cuda_device_count(environ) if device_count is None else device_count
        full_pool = {LOCAL_HOST: local_slots(environ, opts.num_gpus, count)}
        gpu = count > 0
    pool = select_resources(full_pool, opts.include, opts.exclude)
    num_nodes = -1 if (opts.no_ssh and hostfile is None) else opts.num_nodes
    pool = limit_resources(pool, num_nodes=num_nodes, num_gpus=opts.num_gpus)
    return ResolvedPool(pool, full_pool, from_hostfile=hostfile is not None, gpu=gpu)


def is_local_host(host: str) -> bool:
    """Whether ``host`` names the machine the launcher runs on."""
    return host in _LOCAL_NAMES or host in {socket.gethostname(), socket.getfqdn()}


def _device_env(resolved: ResolvedPool, host: str, slots: list[int]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` when the flags narrowed a GPU host's devices, else nothing."""
    if resolved.gpu and slots != resolved.full_pool[host]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}
    return {}


def _torchrun(
    opts: LaunchOptions, num_nodes: int, nproc: int, rank: int, addr: str, local: str = ""
) -> list[str]:
    """One node's torchrun argv; with ``--elastic`` ``addr`` is the rendezvous host, node
    ``rank`` 0 holds its store, and ``local`` is the node's own address."""
    rendezvous = None
    if opts.elastic is not None:
        rdzv_id = opts.elastic.rdzv_id or default_rdzv_id(opts.hostfile, opts.master_port)
        rendezvous = rendezvous_argv(
            opts.elastic, addr, opts.master_port, rdzv_id, is_host=rank == 0, local_addr=local
        )
    return build_torchrun_argv(
        num_nodes=num_nodes,
        nproc_per_node=nproc,
        node_rank=rank,
        master_addr=addr,
        master_port=opts.master_port,
        user_script=opts.user_script,
        user_args=opts.user_args,
        module=opts.module,
        no_python=opts.no_python,
        no_local_rank=opts.no_local_rank,
        log_dir=opts.log_dir,
        python=sys.executable,
        rendezvous=rendezvous,
    )


def _job_env(opts: LaunchOptions) -> dict[str, str]:
    """Variables every node gets from the flags: the log level, the elastic settings."""
    env = {"SHARDSPEED_LOG_LEVEL": opts.log_level.upper()} if opts.log_level else {}
    if opts.elastic is not None:
        env.update(ELASTIC_ENV)
    return env


def build_plan(
    opts: LaunchOptions,
    resolved: ResolvedPool,
    environ: Mapping[str, str],
    cwd: Path,
    home: Path,
) -> list[NodeCommand]:
    """One :class:`NodeCommand` per node to start from this machine."""
    hosts = list(resolved.pool)
    if opts.elastic is not None and not opts.no_ssh:
        _check_elastic_hosts(opts.elastic, hosts)
    if opts.node_rank >= 0 and not opts.no_ssh:
        raise LauncherError(
            f"--node_rank {opts.node_rank} only applies with --no_ssh (start this node only); "
            "add --no_ssh or drop --node_rank."
        )
    if opts.no_ssh:
        return [_no_ssh_node(opts, resolved)]
    if len(hosts) == 1 and (not resolved.from_hostfile or is_local_host(hosts[0])):
        host = hosts[0]
        slots = resolved.pool[host]
        addr = opts.master_addr or "127.0.0.1"
        argv = _torchrun(opts, 1, len(slots), 0, addr, addr)
        env = {**_device_env(resolved, host, slots), **_job_env(opts)}
        return [NodeCommand(host, 0, tuple(slots), argv, argv, env)]

    master_addr = opts.master_addr or hosts[0]
    shared_env = {**remote_env(environ, cwd, home), **_job_env(opts)}
    nodes = []
    for rank, host in enumerate(hosts):
        slots = resolved.pool[host]
        torchrun_argv = _torchrun(opts, len(hosts), len(slots), rank, master_addr, host)
        node_env = {**shared_env, **_device_env(resolved, host, slots)}
        command = build_remote_command(torchrun_argv, str(cwd), node_env)
        if opts.launcher == "pdsh":
            argv = build_pdsh_argv(host, command)
            local_env = {"PDSH_RCMD_TYPE": "ssh"}
            if opts.ssh_port:
                local_env["PDSH_SSH_ARGS_APPEND"] = f"-p {opts.ssh_port}"
        else:
            argv = build_ssh_argv(host, command, opts.ssh_port)
            local_env = {}
        nodes.append(NodeCommand(host, rank, tuple(slots), torchrun_argv, argv, local_env, True))
    return nodes


def _no_ssh_node(opts: LaunchOptions, resolved: ResolvedPool) -> NodeCommand:
    """``--no_ssh``: run only this node's torchrun (one call per node, by the user or Slurm)."""
    hosts = list(resolved.pool)
    if resolved.from_hostfile:
        num_nodes = len(hosts)
    else:
        num_nodes = opts.num_nodes if opts.num_nodes > 0 else 1
    if num_nodes > 1 and opts.node_rank < 0:
        raise LauncherError(
            f"--no_ssh with {num_nodes} nodes needs --node_rank (0..{num_nodes - 1}) to say "
            "which node this is."
        )
    rank = max(opts.node_rank, 0)
    if rank >= num_nodes:
        raise LauncherError(
            f"--node_rank {rank} is out of range for {num_nodes} node(s); use 0..{num_nodes - 1}."
        )
    host = hosts[rank] if resolved.from_hostfile else hosts[0]
    if resolved.from_hostfile:
        master_addr = opts.master_addr or hosts[0]
    elif num_nodes > 1 and not opts.master_addr:
        raise LauncherError(
            f"--no_ssh with --num_nodes {num_nodes} and no hostfile needs --master_addr "
            "(the address of node 0)."
        )
    else:
        master_addr = opts.master_addr or "127.0.0.1"
    slots = resolved.pool[host]
    local = host if resolved.from_hostfile else master_addr if rank == 0 else ""
    argv = _torchrun(opts, num_nodes, len(slots), rank, master_addr, local)
    if opts.elastic is not None and not local:  # torch picks this machine's address
        argv = _drop_option(argv, "--local_addr")
    env = {**_device_env(resolved, host, slots), **_job_env(opts)}
    return NodeCommand(host, rank, tuple(slots), argv, argv, env)


def _drop_option(argv: list[str], option: str) -> list[str]:
    at = argv.index(option)
    return argv[:at] + argv[at + 2 :]


def _check_elastic_hosts(elastic: ElasticOptions, hosts: list[str]) -> None:
    """An elastic job starts on between ``min_nodes`` and ``max_nodes`` hosts."""
    if not elastic.min_nodes <= len(hosts) <= elastic.max_nodes:
        raise LauncherError(
            f"--elastic starts on the {len(hosts)} selected host(s) {hosts}, outside "
            f"--min_nodes {elastic.min_nodes} .. --max_nodes {elastic.max_nodes}; select "
            "that many hosts (--include/--exclude/--num_nodes) or change the bounds."
        )
