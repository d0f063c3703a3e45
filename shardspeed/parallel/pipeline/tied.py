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
    def reduce_grads(self, flat_groups: list[Any]) -> None:
        """Sum the tied weights' accumulated gradients over their tie groups.

        Stages 0/1 accumulate into the flat gradient buffer (``grad_view``); stages 2/3
        under a pipeline leave the window's gradient in ``param.grad`` until the one
        reduction of the batch, so that is what is summed.
        """
        if not self.groups:
            return
        where = {id(p): (g, i) for g in flat_groups for i, p in enumerate(g.params)}
        for key, group in self.groups.items():
            for param in self.tied[key]:
                if id(param) not in where:  # frozen
                    continue
                flat, index = where[id(param)]
                if getattr(flat, "flat_grad", None) is not None:
                    comm.all_reduce(flat.grad_view(index), group=group)
                else:
                    comm.all_reduce(_accumulated_grad(param), group=group)


def _accumulated_grad(param: nn.Parameter) -> torch.Tensor:
    """``param.grad``, created as zeros when this copy got no gradient in the window (a
    ZeRO-3 parameter is gathered for that, since a gradient must match its shape)."""
    if param.grad is None:
        if param.numel() == 0 and hasattr(param, "ds_shape"):
            from shardspeed.zero.init import GatheredParameters

            with GatheredParameters([param]):
                param.grad = torch.zeros_like(param)
        else:
            param.grad = torch.zeros_like(param)
    return param.grad
