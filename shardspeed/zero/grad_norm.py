"""The global gradient norm: one code path for every stage, pipeline, TP and expert layout.

Each rank holds the master gradients of its shard. The global squared norm is the sum,
over every rank that holds a *distinct* piece of the parameters, of its local squared
norm; so the strategy is built once from the layout:

* ``groups``: the process groups to sum over by default — the data axis when gradients
  are sharded over it (ZeRO >= 1; at stage 0 every data rank holds the same reduced
  gradients), the pipe axis when stages hold different layers;
* ``terms``: slices of master gradients summed over *other* groups (tensor-parallel
  shards also over the tensor axis; expert parameters over their expert axes), or not
  counted at all (``groups=None``: a pipeline's tied copy that another stage counts).

Every rank builds the same terms in the same order (a term may hold no slice on a
rank), so the collectives match: one all-reduce per distinct group, over the entries of
the terms that sum over it.

A term's groups may also hold a :class:`RankNormMean`: DeepSpeed's norm for unsharded
(stage-0, fp32) expert gradients. DeepSpeed's ``clip_grad_norm_`` takes each rank's norm
over the gradients it holds (the dense ones and its own experts') and averages those
norms over the data-parallel group, instead of summing the experts' squares over the
expert axis. The marked term's squares then stay on the rank, the norm is rooted per rank
and averaged over the marker's group: the mean of the ranks' norms, at most the true
global norm (equal when every rank's experts have equal norms).

Or an :class:`OverflowOnly`: DeepSpeed's norm for unsharded 16-bit expert gradients under
an optimizer other than ``FusedAdam``. Its FP16/BF16 wrapper clips by the norm of the
dense gradients alone but checks every gradient for overflow. The marked term's squares
are left out of the norm and only reduced over the marker's group (and the term's other
groups), so that a non-finite expert gradient on any rank makes every rank's norm
non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspeed import comm

Slice = tuple[int, int, int]  # (index into the flat list of master gradients, lo, hi)


@dataclass(frozen=True, eq=False)
class RankNormMean:
    """In a term's groups: average the ranks' norms over ``group`` (``size`` ranks) rather
    than summing squares; DeepSpeed's stage-0 norm with expert parameters."""

    group: Any
    size: int


@dataclass(frozen=True, eq=False)
class OverflowOnly:
    """In a term's groups: leave its squares out of the norm, but let a non-finite value on
    any rank of ``group`` make the norm non-finite; DeepSpeed's 16-bit stage-0 norm with
    expert parameters and an optimizer other than ``FusedAdam``."""

    group: Any


@dataclass(frozen=True)
class NormTerm:
    """Master-gradient slices whose squares are summed over ``groups`` (None: not counted)."""

    slices: Sequence[Slice]
    groups: Sequence[Any] | None


@dataclass(frozen=True)
class GradNorm:
    """Computes ``||g||_2`` over all ranks from this rank's master gradients."""

    groups: Sequence[Any]
    device: torch.device
    terms: Sequence[NormTerm] = field(default_factory=tuple)
    # the squared sum is divided by this: with unreduced (per-rank) gradients, the RMS of
    # the ranks' norms, an upper bound of the averaged gradient's norm
    divide: float = 1.0

    def __call__(self, grads: Sequence[torch.Tensor]) -> float:
        # grads: this rank's master gradients, one per (param group, bucket/flat)
        if grads:
            norms = torch._foreach_norm(list(grads), 2.0)
            rest = torch.stack([n.float() for n in norms]).pow(2).sum().to(self.device)
        else:
            rest = torch.zeros((), dtype=torch.float32, device=self.device)
        parts: list[tuple[torch.Tensor, Sequence[Any]]] = []
        for term in self.terms:
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
            for index, lo, hi in term.slices:
                piece = grads[index][lo:hi].float().pow(2).sum().to(self.device)
                if term.groups is None:
                    rest = rest - piece  # counted by another rank
                else:
                    sq = sq + piece
            if term.groups is not None:
                rest = rest - sq
                parts.append((sq, term.groups))
        parts.insert(0, (rest, self.groups))
        means = [g for _, groups in parts for g in groups if isinstance(g, RankNormMean)]
        flagged = [any(isinstance(g, OverflowOnly) for g in gs) for _, gs in parts]
        parts = [(sq, _plain_groups(gs)) for sq, gs in parts]
        # parts summed over different groups can leave ranks one ulp apart (see _agree)
        mixed = len({tuple(id(g) for g in gs) for _, gs in parts}) > 1
        vec, groups = self._sum_over_groups(parts)  # (num_parts,)
        total = vec.sum()
        if any(flagged):
            keep = torch.tensor([not f for f in flagged], device=vec.device)
            # 0 * a finite flagged sum adds nothing; 0 * inf or nan makes the total nan
            total = vec[keep].sum() + 0.0 * vec[~keep].sum()
        if self.divide != 1.0:
            total = total / self.divide
        if means:
            norm = self._mean_of_rank_norms(total, means[0])
            groups = [*groups, means[0].group]
        else:
            norm = total.clamp_min(0).sqrt() if torch.isfinite(total) else total
        return float(_agree(norm.reshape(1), groups)[0] if mixed else norm)

    @staticmethod
    def _mean_of_rank_norms(total: torch.Tensor, mean: RankNormMean) -> torch.Tensor:
        """This rank's norm ``sqrt(total)``, averaged over ``mean.group`` (a non-finite
        norm on any rank makes the mean non-finite, so every rank sees the overflow)."""
        norm = total.clamp_min(0).sqrt() if torch.isfinite(total) else total
        norm = (norm / mean.size).reshape(1)
        comm.all_reduce(norm, group=mean.group)
        return norm[0]

    @staticmethod
    def _sum_over_groups(
        parts: list[tuple[torch.Tensor, Sequence[Any]]],
    ) -> tuple[torch.Tensor, list[Any]]:
        """All-reduce each part over its groups (one collective per distinct group); the
        parts' reduced squares, ``(num_parts,)``, and the groups in the order used."""
        vec = torch.stack([sq for sq, _ in parts])  # (num_parts,)
        order: list[Any] = []
        for _, groups in parts:
            order += [g for g in groups if not any(g is seen for seen in order)]
        for group in order:
            members = [i for i, (_, groups) in enumerate(parts) if any(g is group for g in groups)]
            if len(members) == len(parts):
                comm.all_reduce(vec, group=group)
            else:
                sub = vec[members].clone()
                comm.all_reduce(sub, group=group)
                vec[members] = sub
        return vec, order


def _agree(norm: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """Make every rank hold the same norm bit for bit. When the parts are summed over
    different groups, a part is formed per rank (the uncounted rest by subtraction, so its
    rounding depends on this rank's other slices) and is equal only within its own group:
    ranks can end one ulp apart, and ranks that clip replicated parameters with different
    factors drift apart. The max over the same groups, in the same order, is exact and
    reaches every rank of the mesh."""
    for group in groups:
        comm.all_reduce(norm, op=comm.ReduceOp.MAX, group=group)
    return norm


def _plain_groups(groups: Sequence[Any]) -> list[Any]:
    """A term's process groups to sum over: markers dropped, an OverflowOnly's unwrapped."""
    out = [g.group if isinstance(g, OverflowOnly) else g for g in groups]
    return [g for g in out if not isinstance(g, RankNormMean)]
