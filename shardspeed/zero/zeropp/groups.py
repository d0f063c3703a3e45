"""The ZeRO++ process groups over the data axis: hpZ partitions and qgZ's two stages.

Ranks are counted along the data axis (the ``dp_ranks`` list, ascending global ranks; one
list per data-parallel group of the job). With ``hpz`` ranks per hpZ group and hosts told
apart by :func:`shardspeed.comm.node_groups.host_key`::

    dp ranks [0 1 2 3], hosts a a b b, hpz 2:
      hpZ groups (consecutive blocks of hpz):      [0 1]  [2 3]
      qgZ intra-node groups (one per host):        [0 1]  [2 3]
      qgZ inter-node groups (same local index):    [0 2]  [1 3]

qgZ needs every host to hold one consecutive, equal-sized block of the data axis (rank
``r = node * L + local``); when the hosts do not (or there is one host), it runs one
stage over the whole data axis. :func:`plan_groups` is pure; :func:`build_groups` creates
the process groups (a collective: every rank creates every group, in one order).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupPlan:
    """Rank lists of one data-parallel group's ZeRO++ groups."""

    hpz: tuple[tuple[int, ...], ...]  # consecutive blocks of hpz data ranks
    intra: tuple[tuple[int, ...], ...]  # qgZ stage 1: one per host (one block if flat)
    inter: tuple[tuple[int, ...], ...]  # qgZ stage 2: one per local index (empty if flat)


def plan_groups(dp_ranks: Sequence[int], hosts: Sequence[Hashable], hpz: int) -> GroupPlan:
    """ZeRO++ groups of one data-parallel group (``hosts[i]``: the host of ``dp_ranks[i]``)."""
    world = len(dp_ranks)
    if hpz < 1 or world % hpz:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={hpz} must divide the data-parallel "
            f"size {world}. Fix: set it to the number of ranks per node (a divisor of {world}), "
            "or 1 to turn hpZ off."
        )
    ranks = tuple(dp_ranks)
    hpz_groups = tuple(ranks[i : i + hpz] for i in range(0, world, hpz))
    # hosts in order of first appearance; each must be one consecutive block of equal size
    blocks: list[list[int]] = []
    for rank, host in zip(ranks, hosts):
        if blocks and hosts[ranks.index(blocks[-1][0])] == host:
            blocks[-1].append(rank)
        else:
            blocks.append([rank])
    sizes = {len(b) for b in blocks}
    distinct = len({hosts[ranks.index(b[0])] for b in blocks}) == len(blocks)
    if len(blocks) > 1 and len(sizes) == 1 and distinct:
        local = len(blocks[0])
        inter = tuple(tuple(b[i] for b in blocks) for i in range(local))
        return GroupPlan(hpz_groups, tuple(tuple(b) for b in blocks), inter)
    return GroupPlan(hpz_groups, (ranks,), ())


@dataclass
class ZeroPPGroups:
    """This rank's ZeRO++ groups: ``hpz`` (None when hpZ is off), and qgZ's ``intra``
    (stage 1) and ``inter`` (stage 2; None for one stage) with their sizes."""

    hpz: Any
    hpz_size: int
    hpz_rank: int
    intra: Any
    intra_size: int
    inter: Any
    inter_size: int
    hpz_ranks: tuple[int, ...]
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]


def dp_ranks_of(group: Any) -> list[int]:
    """Global ranks of ``group`` (None/world: every rank), ascending."""
    import torch.distributed as dist

    from shardspeed import comm

    if group is None or group is dist.group.WORLD:
        return list(range(comm.get_world_size()))
    return sorted(dist.get_process_group_ranks(group))


def build_groups(dp_group: Any, hpz: int, hierarchical: bool) -> ZeroPPGroups:
    """Create the ZeRO++ groups of every data-parallel group (collective over the world):
    the hpZ groups when ``hpz`` > 1, qgZ's two stages when ``hierarchical``."""
    from shardspeed import comm
    from shardspeed.comm.node_groups import host_key

    mine = dp_ranks_of(dp_group)
    world = comm.get_world_size()
    everyone: list[Any] = [None] * world
    if world > 1:
        comm.all_gather_object(everyone, (tuple(mine), host_key()))
    else:
        everyone = [(tuple(mine), host_key())]
    host_of = {r: key for r, (_, key) in enumerate(everyone)}
    dp_groups = sorted({ranks for ranks, _ in everyone})
    rank = comm.get_rank()
    plans = [plan_groups(g, [host_of[r] for r in g], hpz) for g in dp_groups]
    spanning = [g for p in plans for g in p.hpz if len({host_of[r] for r in g}) > 1]
    if hpz > 1 and spanning and rank == 0:
        logger.warning(
            "zero_hpz_partition_size=%d: hpZ group %s spans hosts %s, so backward gathers "
            "still cross nodes. Set it to the number of data-parallel ranks per node.",
            hpz, list(spanning[0]), sorted({str(host_of[r]) for r in spanning[0]}),
        )  # fmt: skip
    kinds = (("hpz",) if hpz > 1 else ()) + (("intra", "inter") if hierarchical else ())
    found: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for kind in kinds:  # one order on every rank
        for plan in plans:
            for ranks in getattr(plan, kind):
                group = _group(ranks, world)
                if rank in ranks:
                    found[kind] = (group, ranks)
    hpz_group, hpz_ranks = found.get("hpz", (None, (rank,)))
    intra, intra_ranks = found.get("intra", (dp_group, tuple(mine)))
    inter, inter_ranks = found.get("inter", (None, ()))
    groups = ZeroPPGroups(
        hpz=hpz_group, hpz_size=len(hpz_ranks), hpz_rank=hpz_ranks.index(rank),
        intra=intra, intra_size=len(intra_ranks), inter=inter,
        inter_size=len(inter_ranks) or 1, hpz_ranks=hpz_ranks, intra_ranks=intra_ranks,
        inter_ranks=inter_ranks,
    )  # fmt: skip
    logger.debug("ZeRO++ groups of rank %d: %s", rank, groups)
    return groups


def _group(ranks: tuple[int, ...], world: int) -> Any:
    """The world group, or a new group (created on every rank, members or not)."""
    from shardspeed import comm

    if len(ranks) == world:
        return comm.get_world_group()
    return comm.new_group(list(ranks))
