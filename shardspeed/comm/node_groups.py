"""Node-local process groups: which ranks share a host, and the groups within and across hosts.

The :class:`~shardspeed.topology.Topology` lays ranks on a logical grid; it does not know
where they run. Three things do care about hosts:

* **hierarchical all-reduce**: reduce inside each host over the fast local links, all-reduce
  across hosts with one rank per host and slice, broadcast back inside the host;
* **per-host NVMe swap directories**: ranks of one host share one local disk, so the swap
  files of a host are keyed by ``(host_index, local_rank)``;
* **per-host checkpoint writers**: without a shared filesystem one rank per host writes
  (and later reads) that host's part of a checkpoint.

None of them is wired in yet; this module gives them one answer to "which host am I on".

Hosts are found once per job. Every rank contributes a host key (``SHARDSPEED_HOST_ID`` if
set; else the hostname, plus torchrun's ``GROUP_RANK`` where the launcher set it, because
several agents may share one machine or one hostname, as network namespaces do) and its
launcher's ``LOCAL_WORLD_SIZE``; one ``all_gather_object`` shares them. Hosts are ordered by
their lowest rank, and a host's ranks in ascending order give their local index::

    ranks by host (keys a a b b):   host 0: [0, 1]   host 1: [2, 3]
    intra-host groups (one per host):       [0, 1]           [2, 3]
    inter-host groups (one per local index):  [0, 2]  [1, 3]

The layout itself, :class:`NodeLayout`, is pure and tested without processes; the process
groups, :class:`NodeGroups`, come from :meth:`Topology.node_groups
<shardspeed.topology.Topology.node_groups>` (or :meth:`NodeGroups.build`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HOST_ID_ENV = "SHARDSPEED_HOST_ID"


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of each host: ``hosts[h]`` ascending, hosts ordered by their lowest rank."""

    hosts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        ranks = sorted(r for host in self.hosts for r in host)
        assert ranks == list(range(len(ranks))), f"hosts {self.hosts} must partition the ranks"
        assert all(h and list(h) == sorted(h) for h in self.hosts), self.hosts
        assert [h[0] for h in self.hosts] == sorted(h[0] for h in self.hosts), self.hosts

    @classmethod
    def from_host_keys(cls, keys: Sequence[Hashable]) -> NodeLayout:
        """Group ranks by ``keys[rank]`` (any equal-comparable value naming the host)."""
        by_key: dict[Hashable, list[int]] = {}
        for rank, key in enumerate(keys):
            by_key.setdefault(key, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in by_key.values()))

    @classmethod
    def uniform(cls, world_size: int, local_world_size: int) -> NodeLayout:
        """Contiguous blocks of ``local_world_size`` ranks, as torchrun assigns them."""
        if local_world_size < 1 or world_size % local_world_size:
            raise ValueError(
                f"NodeLayout.uniform: local_world_size={local_world_size} must be >= 1 and "
                f"divide world_size={world_size}."
            )
        n = local_world_size
        return cls(tuple(tuple(range(s, s + n)) for s in range(0, world_size, n)))

    @property
    def world_size(self) -> int:
        return sum(len(h) for h in self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def is_uniform(self) -> bool:
        """Whether every host runs the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    def host_of(self, rank: int) -> int:
        """Index of the host running ``rank``."""
        for index, host in enumerate(self.hosts):
            if rank in host:
                return index
        raise ValueError(f"rank {rank!r} is outside [0, {self.world_size}) for {self!r}")

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` among the ranks of its host."""
        return self.hosts[self.host_of(rank)].index(rank)

    def intra_host_groups(self) -> list[list[int]]:
        """One group per host: the ranks sharing it."""
        return [list(h) for h in self.hosts]

    def inter_host_groups(self) -> list[list[int]]:
        """One group per local index ``i``: rank ``i`` of every host that has one."""
        width = max(len(h) for h in self.hosts)
        return [[h[i] for h in self.hosts if i < len(h)] for i in range(width)]

    def intra_host_ranks(self, rank: int) -> list[int]:
        return list(self.hosts[self.host_of(rank)])

    def inter_host_ranks(self, rank: int) -> list[int]:
        return self.inter_host_groups()[self.local_rank(rank)]

    def spans_hosts(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` (e.g. a Topology axis group) live on more than one host."""
        return len({self.host_of(r) for r in ranks}) > 1


def host_key(environ: Mapping[str, str] | None = None) -> str:
    """This process's host key: ``SHARDSPEED_HOST_ID``, else ``hostname[/GROUP_RANK]``."""
    environ = os.environ if environ is None else environ
    if environ.get(HOST_ID_ENV):
        return environ[HOST_ID_ENV]
    name = socket.gethostname()
    group_rank = environ.get("GROUP_RANK")  # torchrun: this agent's node rank
    return f"{name}/{group_rank}" if group_rank is not None else name


def check_local_world_sizes(layout: NodeLayout, local_world_sizes: Sequence[int | None]) -> None:
    """Raise ``ValueError`` if a launcher's ``LOCAL_WORLD_SIZE`` disagrees with the layout."""
    for index, host in enumerate(layout.hosts):
        for rank in host:
            told = local_world_sizes[rank]
            if told is not None and told != len(host):
                raise ValueError(
                    f"node groups: rank {rank} has LOCAL_WORLD_SIZE={told} but {len(host)} "
                    f"ranks {list(host)} reported the same host key (host {index} of "
                    f"{layout.num_hosts}). Hosts are told apart by hostname and torchrun's "
                    f"GROUP_RANK; where they do not (identical container hostnames), set "
                    f"{HOST_ID_ENV} to a per-host value in each host's environment."
                )


class NodeGroups:
    """This rank's intra-host and inter-host process groups, over a :class:`NodeLayout`.

    A group equal to the whole world is the world group; every other group is created on
    every rank in the same order (intra-host groups, then inter-host groups), as torch
    requires.
    """

    def __init__(self, layout: NodeLayout, rank: int, intra_host: Any, inter_host: Any) -> None:
        self.layout = layout
        self.rank = rank
        self.intra_host = intra_host  # the ranks of this host
        self.inter_host = inter_host  # this local index on every host

    @classmethod
    def build(cls, environ: Mapping[str, str] | None = None) -> NodeGroups:
        """Gather every rank's host key once and create the groups (collective: all ranks)."""
        from shardspeed import comm

        environ = os.environ if environ is None else environ
        local_world = environ.get("LOCAL_WORLD_SIZE")
        mine = (host_key(environ), int(local_world) if local_world else None)
        gathered: list[Any] = [None] * comm.get_world_size()
        if comm.get_world_size() > 1:
            comm.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        layout = NodeLayout.from_host_keys([key for key, _ in gathered])
        check_local_world_sizes(layout, [size for _, size in gathered])
        rank = comm.get_rank()
        intra = _make_groups(layout.intra_host_groups(), rank, layout.world_size)
        inter = _make_groups(layout.inter_host_groups(), rank, layout.world_size)
        logger.debug("node groups: %d hosts %s", layout.num_hosts, layout.hosts)
        return cls(layout, rank, intra, inter)

    @property
    def num_hosts(self) -> int:
        return self.layout.num_hosts

    @property
    def host_index(self) -> int:
        """Index of this rank's host (hosts ordered by their lowest rank)."""
        return self.layout.host_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.layout.local_rank(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.layout.hosts[self.host_index])

    def intra_host_ranks(self) -> list[int]:
        return self.layout.intra_host_ranks(self.rank)

    def inter_host_ranks(self) -> list[int]:
        return self.layout.inter_host_ranks(self.rank)

    def __repr__(self) -> str:
        return (
            f"NodeGroups(rank={self.rank}, host={self.host_index} of {self.num_hosts}, "
            f"intra_host={self.intra_host_ranks()}, inter_host={self.inter_host_ranks()})"
        )


def _make_groups(groups: list[list[int]], rank: int, world_size: int) -> Any:
    """Create every group (same order on all ranks); return the one containing ``rank``."""
    from shardspeed import comm

    mine = None
    for ranks in groups:
        group = comm.get_world_group() if len(ranks) == world_size else comm.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
