"""Elastic launches: every node runs torchrun's elastic agent against one c10d rendezvous.

``shardspeed --elastic --min_nodes N --max_nodes M`` replaces the static rendezvous (node
rank = hostfile order, fixed ``--nnodes``) with torchrun's own::

    python -m torch.distributed.run --nnodes N:M --nproc_per_node n \\
        --rdzv_backend c10d --rdzv_endpoint HOST0:PORT --rdzv_id ID \\
        --rdzv_conf is_host=1|0,join_timeout=..,last_call_timeout=.. \\
        --local_addr HOST --max_restarts R <entry>

The first selected host (or ``--master_addr``) holds the rendezvous store, so it must stay
up; any other host may leave or join. When a worker fails (a peer host was lost) each
surviving agent restarts its workers, up to ``--max_restarts`` times, and the rendezvous
forms a new world of the hosts still there (at least ``--min_nodes``). When a host comes
back its agent joins the waiting list, and the running agents restart their workers at a
world that includes it (this does not count as a restart). Ranks come from the
rendezvous, not from hostfile order.

Every node also gets :data:`ELASTIC_ENV`. The store host is named explicitly (``is_host``) because torch decides it by matching the
endpoint with the machine's hostname, which is wrong where a host's name does not resolve
to the address the hostfile uses (containers, network namespaces, several NICs).
``--local_addr`` is the host's hostfile name for the same reason: the workers' MASTER_ADDR
is rank 0's ``--local_addr``.

Resuming after a restart is the training script's part:
:func:`shardspeed.runtime.elastic_resume.resume_elastic` loads the latest committed
checkpoint at the new world size.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from shardspeed.launcher.errors import LauncherError

DEFAULT_MAX_RESTARTS = 3
DEFAULT_JOIN_TIMEOUT_S = 600
DEFAULT_LAST_CALL_TIMEOUT_S = 5
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Exported on every node of an elastic job. With torch's default (the agents' rendezvous
TCPStore shared with the workers) a node that stays rank 0 does not republish the workers'
store address in a later round, so a host that joins then waits for it until its timeout;
each round's rank 0 publishing a fresh address makes rejoining work (the drill tests it)."""
_CONF_ITEM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=[^,]*$")


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic launch flags (``--min_nodes``, ``--max_nodes``, ...)."""

    min_nodes: int
    max_nodes: int
    max_restarts: int = DEFAULT_MAX_RESTARTS
    rdzv_id: str = ""
    rdzv_conf: str = ""

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise LauncherError(
                f"--min_nodes must be >= 1, got {self.min_nodes}; pass the fewest hosts the "
                "job may run on."
            )
        if self.max_nodes < self.min_nodes:
            raise LauncherError(
                f"--max_nodes ({self.max_nodes}) must be >= --min_nodes ({self.min_nodes})."
            )
        if self.max_restarts < 0:
            raise LauncherError(f"--max_restarts must be >= 0, got {self.max_restarts}.")
        for item in filter(None, self.rdzv_conf.split(",")):
            if not _CONF_ITEM.match(item) or item.startswith("is_host="):
                raise LauncherError(
                    f"--rdzv_conf item {item!r} is not KEY=VALUE (is_host is set by the "
                    "launcher); e.g. --rdzv_conf join_timeout=300,last_call_timeout=10."
                )


def default_rdzv_id(hostfile: str | None, port: int) -> str:
    """A job id every node agrees on: the launcher's pid, hostfile and port."""
    stem = os.path.basename(hostfile) if hostfile else "local"
    return f"shardspeed-{os.getpid()}-{stem}-{port}"


def rendezvous_argv(
    opts: ElasticOptions, endpoint: str, port: int, rdzv_id: str, *, is_host: bool, local_addr: str
) -> list[str]:
    """torchrun's rendezvous options for one node (they replace the static ones)."""
    conf = {
        "join_timeout": str(DEFAULT_JOIN_TIMEOUT_S),
        "last_call_timeout": str(DEFAULT_LAST_CALL_TIMEOUT_S),
    }
    for item in filter(None, opts.rdzv_conf.split(",")):
        key, _, value = item.partition("=")
        conf[key] = value
    conf_text = ",".join([f"is_host={int(is_host)}", *(f"{k}={v}" for k, v in conf.items())])
    return [
        "--nnodes", f"{opts.min_nodes}:{opts.max_nodes}",
        "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"{endpoint}:{port}",
        "--rdzv_id", rdzv_id,
        "--rdzv_conf", conf_text,
        "--local_addr", local_addr,
        "--max_restarts", str(opts.max_restarts),
    ]  # fmt: skip
