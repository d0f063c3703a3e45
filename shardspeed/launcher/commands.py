"""Command lines the launcher runs (pure functions).

Every node runs the same ``torchrun`` invocation with a static rendezvous::

    python -m torch.distributed.run --nnodes K --nproc_per_node n --node_rank r \\
        --master_addr A --master_port P <entry>

The nodes share ``--nnodes``, ``--master_addr`` and ``--master_port``; only
``--node_rank`` (and ``--nproc_per_node`` for uneven hosts) differ. Node rank ``r`` is the
``r``-th host of the resource pool, so global ranks follow hostfile order. The static
scheme is deterministic and needs no job id. An elastic launch (``--elastic``) uses
torchrun's c10d rendezvous instead (:mod:`shardspeed.launcher.elastic`).

``<entry>`` gives the user's script ``--local_rank=<n>`` as its first argument (as the
``deepspeed`` launcher does) by running it through :mod:`shardspeed.launcher.local_rank_shim`;
with ``no_local_rank`` torchrun runs the script directly.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence

SHIM_MODULE = "shardspeed.launcher.local_rank_shim"


def build_entry_argv(
    user_script: str,
    user_args: Sequence[str] = (),
    *,
    module: bool = False,
    no_python: bool = False,
    no_local_rank: bool = False,
) -> list[str]:
    """The part of the torchrun argv after its own options: what each worker runs."""
    if no_local_rank:
        mode = ["--module"] if module else ["--no-python"] if no_python else []
        return [*mode, user_script, *user_args]
    shim_mode = ["--module"] if module else ["--no-python"] if no_python else []
    return ["--module", SHIM_MODULE, *shim_mode, "--", user_script, *user_args]


def build_torchrun_argv(
    *,
    num_nodes: int,
    nproc_per_node: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    user_script: str,
    user_args: Sequence[str] = (),
    module: bool = False,
    no_python: bool = False,
    no_local_rank: bool = False,
    log_dir: str | None = None,
    python: str | None = None,
    rendezvous: Sequence[str] | None = None,
) -> list[str]:
    """The full ``python -m torch.distributed.run ...`` argv for one node.

    ``log_dir`` adds ``--log_dir DIR --tee 3``: every rank's stdout/stderr also goes to a
    file under ``DIR``. ``python`` defaults to the launcher's interpreter. ``rendezvous``
    (an elastic launch, :mod:`shardspeed.launcher.elastic`) replaces the static
    ``--nnodes``/``--node_rank``/``--master_addr``/``--master_port``.
    """
    argv = [python or sys.executable, "-m", "torch.distributed.run"]
    if rendezvous is not None:
        argv += [*rendezvous, "--nproc_per_node", str(nproc_per_node)]
    else:
        argv += [
            "--nnodes", str(num_nodes),
            "--nproc_per_node", str(nproc_per_node),
            "--node_rank", str(node_rank),
            "--master_addr", master_addr,
            "--master_port", str(master_port),
        ]  # fmt: skip
    if log_dir:
        argv += ["--log_dir", log_dir, "--tee", "3"]
    entry = build_entry_argv(
        user_script,
        user_args,
        module=module,
        no_python=no_python,
        no_local_rank=no_local_rank,
    )
    return argv + entry


def build_remote_command(argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> str:
    """One shell line for a remote node: ``cd CWD && export K=V ... && <argv>``."""
    parts = [f"cd {shlex.quote(cwd)}"]
    if env:
        exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in env.items())
        parts.append(f"export {exports}")
    parts.append(shlex.join(argv))
    return " && ".join(parts)


def build_ssh_argv(host: str, remote_command: str, ssh_port: int | None = None) -> list[str]:
    """``ssh [-p PORT] HOST '<remote command>'`` as an argv (no local shell involved)."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", *port, host, remote_command]


def build_pdsh_argv(host: str, remote_command: str) -> list[str]:
    """``pdsh -S -w HOST '<remote command>'``: pdsh's transport, one call per node.

    One call per node keeps ``--node_rank`` explicit; ``-S`` makes pdsh return the remote
    exit status. The ssh port goes through ``PDSH_SSH_ARGS_APPEND`` (see the plan).
    """
    return ["pdsh", "-S", "-w", host, remote_command]


def format_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """A copy-pasteable shell line: ``VAR=VAL ... argv`` with shell quoting."""
    prefix = [f"{name}={shlex.quote(value)}" for name, value in (env or {}).items()]
    return " ".join([*prefix, shlex.join(argv)])
