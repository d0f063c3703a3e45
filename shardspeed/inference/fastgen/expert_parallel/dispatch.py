"""Dispatch and combine of one routed layer over the expert-parallel ranks.

Every rank holds every token (the dense parts are replicated) and routes all of
them, so every rank knows the whole routing: the uneven all-to-all splits follow
from it and need no count exchange. Per routed layer, on rank ``r`` of ``E``::

    weights, experts = router(x)                    [N, k] each, identical on all ranks
    pairs sorted by (expert, token); source of a pair = the slice its token is in
    send   = x[my pairs]                            (expert, token) order: owners' blocks
    recv   = all_to_all(send, splits)               [source rank][my expert] blocks
    y_e    = expert e (rows of e from all sources)  token order, as one process runs it
    back   = all_to_all(y, splits swapped)          my pairs' expert outputs
    mine   = sum_e back * weight (ascending e) + shared_expert(x)[my slice]
    out    = all_gather(mine)                       [N, hidden] on every rank

Each expert runs on the same rows in the same order as on one process and each
token's routes are summed in the same order, so the result is the single-process
block's. No token is ever dropped (there is no capacity at inference).

That is :class:`ExpertExchange` (``EngineConfig.expert_parallel_dispatch="all_to_all"``,
DeepSpeed-MoE's dispatch / combine, three collectives per routed layer).
:class:`GatherExchange` (``"all_gather"``) uses that every rank already holds every
token: owners run their experts on all their routed rows and one all-gather hands every
expert output to every rank (one collective, more bytes), with the same numerics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch.autograd.profiler import record_function

from shardspeed.inference.fastgen.expert_parallel.placement import ExpertPlacement, token_bounds

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.models.moe import SparseMoE


class ExpertComm(Protocol):
    """The two collectives of the exchange over the ``ep_size`` ranks."""

    def all_to_all(
        self, x: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        """Rows ``input_splits[j]`` of ``x`` go to rank ``j``; ``output_splits[i]`` rows come
        from rank ``i``."""
        ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all), in rank order."""
        ...


def sort_pairs(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (token, slot) pair of ``experts`` ``[N, k]`` sorted by (expert, token): the pair
    order (index into the flattened ``[N * k]``), its expert and its token. A token's k
    experts are distinct, so the keys are unique."""
    num_tokens, k = experts.shape
    pair_expert = experts.reshape(-1)  # [N * k], pair i = (token i // k, slot i % k)
    pair_token = torch.arange(num_tokens, device=experts.device).repeat_interleave(k)
    order = torch.argsort(pair_expert * num_tokens + pair_token)
    return order, pair_expert[order], pair_token[order]


class ExpertExchange:
    """The ``exchange`` of a :class:`~shardspeed.inference.fastgen.models.moe.SparseMoE`
    that holds the experts of ``placement`` (see the module docstring)."""

    def __init__(self, placement: ExpertPlacement, comm: ExpertComm) -> None:
        self.placement = placement
        self.comm = comm

    def __call__(
        self, block: SparseMoE, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        p = self.placement
        ep, rank, num_local = p.ep_size, p.rank, p.experts_per_rank
        num_tokens, k = experts.shape
        bounds = token_bounds(num_tokens, ep)
        lo, hi = bounds[rank], bounds[rank + 1]
        order, sorted_expert, sorted_token = sort_pairs(experts)
        edges = torch.tensor(bounds[1:-1], device=x.device)
        source = torch.bucketize(sorted_token, edges, right=True)  # rank whose slice has it
        counts = torch.zeros(ep, p.num_experts, dtype=torch.long, device=x.device)
        counts.index_put_((source, sorted_expert), torch.ones_like(source), accumulate=True)
        by_owner = counts.view(ep, ep, num_local)  # [source, owner, local expert]
        input_splits = by_owner[rank].sum(dim=1).tolist()  # my pairs to each owner
        recv_counts = by_owner[:, rank]  # [source, my local expert]
        output_splits = recv_counts.sum(dim=1).tolist()

        mine = source == rank
        my_token = sorted_token[mine]
        my_slot = order[mine] % k
        with record_function("fastgen.ep.dispatch"):
            recv = self.comm.all_to_all(x.index_select(0, my_token), output_splits, input_splits)
        y = self._run_local(block, recv, recv_counts)  # [N_recv, hidden], source-major
        with record_function("fastgen.ep.combine"):
            back = self.comm.all_to_all(y, input_splits, output_splits)  # [N_mine_pairs, hidden]
        routed = back * weights[my_token, my_slot, None]  # fp32, as one process
        out = torch.zeros(hi - lo, x.shape[1], dtype=x.dtype, device=x.device)
        out.index_add_(0, my_token - lo, routed.to(out.dtype))  # ascending expert per token
        shared = block.shared(x)  # on every token, as the other dense parts: the same
        if shared is not None:  # rows as one process (a slice alone may round differently)
            out = out + shared[lo:hi]
        return self._gather(out, bounds)

    def _run_local(
        self, block: SparseMoE, recv: torch.Tensor, recv_counts: torch.Tensor
    ) -> torch.Tensor:
        """Run each local expert on its rows from every source (token order) and put the
        outputs back in the received (source-major) layout."""
        ep, num_local = recv_counts.shape
        if recv.shape[0] == 0:
            return recv
        local_of_row = torch.arange(num_local, device=recv.device).repeat(ep)
        local_of_row = local_of_row.repeat_interleave(recv_counts.reshape(-1))  # [N_recv]
        by_expert = torch.argsort(local_of_row, stable=True)
        grouped = recv.index_select(0, by_expert).split(recv_counts.sum(dim=0).tolist())
        first = self.placement.local_experts.start
        outs = [
            block.run_expert(first + j, rows) if rows.shape[0] else rows
            for j, rows in enumerate(grouped)
        ]
        return torch.cat(outs).index_select(0, torch.argsort(by_expert))

    def _gather(self, mine: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Every rank's slice, concatenated: ``[N, hidden]``."""
        width = bounds[1] - bounds[0]  # the longest slice (the first ones are longest)
        padded = mine
        if mine.shape[0] < width:
            padded = torch.cat([mine, mine.new_zeros(width - mine.shape[0], mine.shape[1])])
        with record_function("fastgen.ep.all_gather"):
            parts = self.comm.all_gather(padded)
        sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])


class GatherExchange:
    """One collective per routed layer instead of three (``dispatch="all_gather"``).

    Every rank already holds every token, so each owner runs its experts on all the
    rows routed to them (the single-process rows, in token order), the ranks
    all-gather those expert outputs, and every rank combines all tokens (ascending
    expert per token, as one process)::

        y_mine = [expert e(x[tokens of e]) for e in my experts]    [pairs of my experts, H]
        y_all  = all_gather(y_mine)                                 [N * k, H], (expert, token)
        out    = sum_e y_all * weight  (+ shared_expert(x))         [N, H]

    It moves every expert output to every rank (``N * k`` rows) where the all-to-all
    path moves ``N * k / E`` per rank and back plus one gather of ``N / E`` rows: on a
    CPU, where each collective costs about a millisecond, fewer round trips win.
    """

    def __init__(self, placement: ExpertPlacement, comm: ExpertComm) -> None:
        self.placement = placement
        self.comm = comm

    def __call__(
        self, block: SparseMoE, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        p = self.placement
        order, sorted_expert, sorted_token = sort_pairs(experts)
        per_expert = torch.bincount(sorted_expert, minlength=p.num_experts)  # [E]
        per_owner = per_expert.view(p.ep_size, p.experts_per_rank).sum(dim=1).tolist()
        first = sum(per_owner[: p.rank])
        mine = sorted_token[first : first + per_owner[p.rank]]  # my experts' tokens
        sizes = per_expert[p.local_experts.start : p.local_experts.stop].tolist()
        rows = x.index_select(0, mine).split(sizes)
        ys = [
            block.run_expert(p.local_experts.start + j, r) if r.shape[0] else r
            for j, r in enumerate(rows)
        ]
        width = max(per_owner)
        y = torch.cat(ys) if ys else x.new_zeros(0, x.shape[1])
        if y.shape[0] < width:
            y = torch.cat([y, y.new_zeros(width - y.shape[0], y.shape[1])])
        with record_function("fastgen.ep.all_gather"):
            parts = self.comm.all_gather(y)
        y_all = torch.cat([part[:n] for part, n in zip(parts, per_owner)])  # [N * k, H]
        routed = y_all * weights.reshape(-1)[order, None]  # fp32, as one process
        out = torch.zeros_like(x)
        out.index_add_(0, sorted_token, routed.to(out.dtype))
        shared = block.shared(x)
        return out if shared is None else out + shared


DISPATCHES = {"all_to_all": ExpertExchange, "all_gather": GatherExchange}
