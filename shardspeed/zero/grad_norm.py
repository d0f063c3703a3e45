"""The global gradient norm: one code path for every stage, pipeline and (later) TP/EP.

Each rank holds the master gradients of its shard. The global squared norm is the sum,
over every rank that holds a *distinct* piece of the parameters, of its local squared
norm; so the strategy is built once from the layout:

* ``groups``: the process groups to sum over — the data axis when gradients are sharded
  over it (ZeRO >= 1; at stage 0 every data rank holds the same reduced gradients), the
  pipe axis when stages hold different layers;
* ``excluded``: slices of master gradients that another rank also counts (a pipeline's
  tied copies on later stages), subtracted before the sum so they count once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspeed import comm


@dataclass(frozen=True)
class GradNorm:
    """Computes ``||g||_2`` over all ranks from this rank's master gradients."""

    groups: Sequence[Any]
    device: torch.device
    # (index into the flat list of master gradients, lo, hi): slices counted elsewhere
    excluded: Sequence[tuple[int, int, int]] = field(default_factory=tuple)

    def __call__(self, grads: Sequence[torch.Tensor]) -> float:
        # grads: this rank's master gradients, one per (param group, bucket/flat)
        if grads:
            norms = torch._foreach_norm(list(grads), 2.0)
            sq = torch.stack([n.float() for n in norms]).pow(2).sum().to(self.device)
        else:
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for index, lo, hi in self.excluded:
            sq = sq - grads[index][lo:hi].float().pow(2).sum().to(self.device)
        for group in self.groups:
            comm.all_reduce(sq, group=group)
        return float(sq.clamp_min(0).sqrt()) if torch.isfinite(sq) else float(sq)
