"""Tied weights across stages: one process group per tie key, start in sync, sum gradients.

A ``TiedLayerSpec`` key held by several stages (the input embedding on the first stage
and the LM head on the last) gives each of them a copy of the weight. The copies start
from the lowest stage's values and their gradients are summed over the *tie group* (the
ranks holding the key that share every other coordinate) before the data-parallel
reduction, so every copy takes the same optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from shardspeed import comm
from shardspeed.topology import Topology
from shardspeed.zero.flat_buffer import FlatGroup


class TiedWeights:
    """The tie groups of this rank and the collectives on them."""

    def __init__(self, tied: dict[str, list[nn.Parameter]], owners: dict[str, list[int]],
                 topology: Topology) -> None:  # fmt: skip
        self.tied = tied
        self.owners = owners
        self.groups: dict[str, Any] = {}
        self.src: dict[str, int] = {}
        me = topology.coords(topology.rank)
        # Every rank creates every group, in the same order (torch requires it).
        for key, stages in owners.items():
            if len(stages) < 2:
                continue
            for data in range(topology.dp):
                for seq in range(topology.sp):
                    for tensor in range(topology.tp):
                        ranks = [
                            topology.rank_of(pipe=s, data=data, sequence=seq, tensor=tensor)
                            for s in stages
                        ]
                        group = comm.new_group(ranks)
                        if topology.rank in ranks and key in tied:
                            self.groups[key] = group
                            self.src[key] = topology.rank_of(
                                pipe=stages[0], data=me.data, sequence=me.sequence, tensor=me.tensor
                            )

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """Copy every tied weight from the lowest stage holding it."""
        for key, group in self.groups.items():
            for param in self.tied[key]:
                comm.broadcast(param.data, src=self.src[key], group=group)

    @torch.no_grad()
    def reduce_grads(self, flat_groups: list[FlatGroup]) -> None:
        """Sum the tied weights' accumulated gradients over their tie groups."""
        if not self.groups:
            return
        where = {id(p): (g, i) for g in flat_groups for i, p in enumerate(g.params)}
        for key, group in self.groups.items():
            for param in self.tied[key]:
                if id(param) not in where:  # frozen
                    continue
                flat, index = where[id(param)]
                comm.all_reduce(flat.grad_view(index), group=group)
