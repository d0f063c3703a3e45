"""Dispatch and combine: tokens to their experts over the expert group, and results back.

Experts are sharded over the topology's ``expert`` axis: rank ``j`` of an expert group of
``ep`` ranks holds global experts ``j * L .. (j + 1) * L - 1`` (``L`` local experts), as in
DeepSpeed. Two strategies, chosen once per layer from ``drop_tokens``:

``CapacityDispatch`` (tokens are dropped): every expert has ``C`` slots on every rank, so
the exchange is one even all-to-all of a padded buffer (DeepSpeed's layout)::

    tokens (S, M) --encode--> (E, C, M) --all-to-all--> (ep, L, C, M) --experts-->
    (ep, L, C, M) --all-to-all--> (E, C, M) --combine--> (S, M)

``UnevenDispatch`` (no token dropped): only routed tokens travel. Each rank sorts its
(route, token) pairs by expert, the ranks exchange per-expert counts (an all-to-all of E
integers, which is all DeepSpeed's max-capacity all-reduce would tell them and more), and
the tokens go in one ``all_to_all_single`` with uneven splits::

    pairs sorted by expert (N_send, M) --all-to-all(splits)--> (N_recv, M), by source rank
    --regroup by local expert--> experts --ungroup--> --all-to-all(splits swapped)-->
    (N_send, M) --combine--> (S, M)

DeepSpeed pads to the largest load instead; the outputs are the same, and each expert
sees a (tokens, M) matrix instead of a (ep, 1, C, M) buffer.

Combining sums each token's routes weighted by their fp32 gate weights, in fp32, and
casts to the expert output's dtype, as DeepSpeed does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.profiler import record_function

from shardspeed import comm

if TYPE_CHECKING:
    from shardspeed.parallel.moe.experts import Experts
    from shardspeed.parallel.moe.gating import Routing


def _group_size(group: Any) -> int:
    return 1 if group is None or not comm.is_initialized() else comm.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward is the reverse exchange (splits swapped)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        input: Tensor,
        group: Any,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
    ) -> Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        input = input.contiguous()
        rows = input.shape[0] if output_splits is None else sum(output_splits)
        output = input.new_empty((rows, *input.shape[1:]))
        comm.all_to_all_single(output, input, output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        grad = _AllToAll.apply(grad_output, ctx.group, ctx.input_splits, ctx.output_splits)
        return grad, None, None, None


def all_to_all_single(
    input: Tensor,
    group: Any,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
) -> Tensor:
    """Differentiable all-to-all over dim 0: row block ``j`` of ``input`` goes to group rank j.

    Without splits the blocks are equal (dim 0 divisible by the group size); with them,
    ``input_splits[j]`` rows go to rank ``j`` and ``output_splits[i]`` rows come from rank i.
    """
    return _AllToAll.apply(input, group, output_splits, input_splits)


def agreed_capacity(exp_counts: Tensor, group: Any) -> int:
    """The largest expert load on any rank of ``group`` (DeepSpeed's no-drop capacity)."""
    load = exp_counts.max().reshape(1).to(torch.int64)
    if _group_size(group) > 1:
        comm.all_reduce(load, op=comm.ReduceOp.MAX, group=group)
    return int(load.item())


def _combine(expert_rows: Tensor, row_of_route: Tensor, weights: Tensor) -> Tensor:
    """(S, M): sum over routes of ``weights[r, s] * expert_rows[row_of_route[r, s]]``.

    ``row_of_route`` (k, S) indexes ``expert_rows`` (N, M); index N means "dropped" (zeros).
    """
    k, num_tokens = row_of_route.shape
    padded = torch.cat([expert_rows, expert_rows.new_zeros(1, expert_rows.shape[1])])
    routed = padded.index_select(0, row_of_route.reshape(-1)).view(k, num_tokens, -1)
    combined = (routed * weights.unsqueeze(-1)).sum(dim=0)  # (S, M) fp32
    return combined.to(expert_rows.dtype)


@dataclass(frozen=True)
class CapacityDispatch:
    """Padded (E, C, M) buffers and an even all-to-all (``drop_tokens=True``)."""

    group: Any
    ep_size: int
    num_local_experts: int

    def __call__(self, tokens: Tensor, routing: Routing, experts: Experts) -> Tensor:
        num_tokens, hidden = tokens.shape
        num_experts, capacity = routing.num_experts, routing.capacity
        assert capacity is not None, "CapacityDispatch needs a capacity (drop_tokens=True)"
        num_slots = num_experts * capacity
        # flat slot of every route; dropped routes point at the pad slot num_slots
        slot = torch.where(
            routing.kept, routing.expert_ids * capacity + routing.locations, num_slots
        )
        source = torch.full((num_slots + 1,), num_tokens, dtype=torch.long, device=tokens.device)
        token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(slot)
        source.scatter_(0, slot.reshape(-1), token_ids.reshape(-1))  # slot -> token (or pad)
        padded = torch.cat([tokens, tokens.new_zeros(1, hidden)])
        buf = padded.index_select(0, source[:num_slots]).view(num_experts, capacity, hidden)
        with record_function("moe.dispatch.all_to_all"):
            if self.ep_size > 1:
                buf = all_to_all_single(buf, self.group)  # (ep * L, C, M) by source rank
        out = experts(buf.view(self.ep_size, self.num_local_experts, capacity, hidden))
        out = out.reshape(num_experts, capacity, -1)  # (E, C, M)
        with record_function("moe.combine.all_to_all"):
            if self.ep_size > 1:
                out = all_to_all_single(out, self.group)  # (E, C, M) for this rank's tokens
        return _combine(out.reshape(num_slots, -1), slot, routing.weights)


@dataclass(frozen=True)
class UnevenDispatch:
    """Only routed tokens travel, with uneven all-to-all splits (``drop_tokens=False``)."""

    group: Any
    ep_size: int
    num_local_experts: int

    def __call__(self, tokens: Tensor, routing: Routing, experts: Experts) -> Tensor:
        num_experts, num_local = routing.num_experts, self.num_local_experts
        device = tokens.device
        ids = routing.expert_ids.reshape(-1)  # (k * S,) route-major
        token_of_pair = torch.arange(routing.num_tokens, device=device).repeat(routing.k)
        # pairs sorted by expert (stable: token order within an expert); dropped pairs last
        order = torch.argsort(torch.where(ids >= 0, ids, num_experts), stable=True)
        send_counts = torch.bincount(ids[ids >= 0], minlength=num_experts)  # (E,)
        order = order[: int(send_counts.sum())]
        send = tokens.index_select(0, token_of_pair[order])  # (N_send, M)
        if self.ep_size > 1:
            recv_counts = torch.empty_like(send_counts)  # (ep * L,): [source rank, local e]
            comm.all_to_all_single(recv_counts, send_counts, group=self.group)
            in_splits = send_counts.view(self.ep_size, num_local).sum(dim=1).tolist()
            out_splits = recv_counts.view(self.ep_size, num_local).sum(dim=1).tolist()
            with record_function("moe.dispatch.all_to_all"):
                recv = all_to_all_single(send, self.group, out_splits, in_splits)
        else:
            recv_counts, recv = send_counts, send
        # regroup the received rows (source-major) by local expert
        per_source = recv_counts.view(self.ep_size, num_local)
        local_of_row = torch.arange(num_local, device=device).repeat(self.ep_size)
        local_of_row = local_of_row.repeat_interleave(per_source.reshape(-1))  # (N_recv,)
        by_expert = torch.argsort(local_of_row, stable=True)
        grouped = recv.index_select(0, by_expert).split(per_source.sum(dim=0).tolist())
        outs = [experts.run_expert(local, rows) for local, rows in enumerate(grouped)]
        out = torch.cat(outs).index_select(0, torch.argsort(by_expert))  # source-major again
        if self.ep_size > 1:
            with record_function("moe.combine.all_to_all"):
                out = all_to_all_single(out, self.group, in_splits, out_splits)  # (N_send, M)
        # row of `out` that holds each (route, token) pair; dropped pairs -> pad row
        row_of_pair = torch.full_like(ids, out.shape[0])
        row_of_pair[order] = torch.arange(order.numel(), device=device)
        return _combine(out, row_of_pair.view(routing.k, -1), routing.weights)


def make_dispatch(
    drop_tokens: bool, group: Any, ep_size: int, num_local_experts: int
) -> CapacityDispatch | UnevenDispatch:
    """The dispatch strategy for a layer (chosen once)."""
    cls = CapacityDispatch if drop_tokens else UnevenDispatch
    return cls(group, ep_size, num_local_experts)
