"""qgZ: the gradient reduce-scatter as quantized all-to-alls, within the node then across.

A :class:`~shardspeed.zero.grad_reduction.GradReduction` for stage 3
(``zero_quantized_gradients``). The bucket ``buf`` is ``W = H * L`` shard rows (H nodes
of L ranks; data rank ``r = node * L + local`` owns row ``r``)::

    buf (W * S,) -> rows (H, L, S): rows[h, l] is the shard of rank h * L + l
    stage 1, within the node (all-to-all over L ranks):
        send to local rank l' the H rows [:, l'] (the shards of every node's rank l'),
        quantized; receive L such blocks, dequantize and sum: (H, S), this node's partial
        sums of the shards of local index l on every node
    stage 2, across nodes (all-to-all over the H ranks of local index l):
        send row h' of the partial sums to node h', quantized; receive H rows,
        dequantize and sum: (S,), this rank's shard summed over all W ranks

With one node (or hosts that are not equal consecutive blocks of the data axis) stage 1
runs over the whole data group and stage 2 is skipped; with one rank per node stage 1 is
skipped. Codes are int4 by default (as
DeepSpeed's qgZ) in blocks of :data:`~shardspeed.zero.zeropp.quantize.GRAD_BLOCK`
elements per fp32 scale.

Error bound (rounding to nearest, :func:`~shardspeed.zero.zeropp.quantize.error_bound`):
every quantized row element is off by at most ``absmax(its block) / (2 * qmax)``, so this
rank's summed shard differs from the exact sum by at most the stage-1 bound of each of
the W source rows plus the stage-2 bound of each of the H partial-sum rows
(:func:`reduction_error_bound`). int4: qmax 7, 1/14 of each block's largest magnitude per
stage and source; int8: 1/254.

The collectives run synchronously when the reducer launches the bucket, so unlike the
default asynchronous reduce-scatter they do not overlap the rest of backward (overlapping
stage 1 is possible: stage 2 must then start in the same order on every rank, at flush).
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm
from shardspeed.zero.grad_reduction import Launched
from shardspeed.zero.zeropp.quantize import GRAD_BLOCK, Quantized, dequantize_rows, quantize_rows

QGZ_BITS = 4


class QuantizedReduction:
    """qgZ: sum a stage-3 gradient bucket over the data ranks with quantized all-to-alls."""

    def __init__(
        self,
        *,
        world_size: int,
        intra: Any,
        intra_size: int,
        inter: Any,
        inter_size: int,
        bits: int = QGZ_BITS,
        block: int = GRAD_BLOCK,
        average_over: int | None = None,
    ) -> None:
        if intra_size * inter_size != world_size:
            raise ValueError(
                f"qgZ: intra-node size {intra_size} x inter-node size {inter_size} must equal "
                f"the data-parallel size {world_size}."
            )
        self.world_size = world_size
        self.intra, self.local = intra, intra_size
        self.inter, self.nodes = inter, inter_size
        self.bits = bits
        self.block = block
        self.average_over = world_size if average_over is None else average_over
        self.bytes_sent = 0  # codes + scales this rank sent, over all reductions
        # largest stage-1 / stage-2 error bounds (half a step of every source's block,
        # summed over the sources) of any element this rank summed since the last reset;
        # with their maxima over all ranks, ``nodes * stage1 + stage2`` bounds the error of
        # every reduced element (error_bound_from)
        self.max_stage_bounds = [0.0, 0.0]

    @torch.no_grad()
    def launch(self, buf: torch.Tensor, shard: tuple[int, int] | None) -> Launched:
        if self.world_size == 1:
            return Launched(buf, None, full=True)
        if shard is None:  # every rank keeps the whole bucket: not a qgZ case
            work = comm.all_reduce(buf, group=self.intra, async_op=True)
            return Launched(buf, work, full=True)
        shard_numel = shard[1] - shard[0]
        rows = buf.view(self.nodes, self.local, shard_numel)  # (H, L, S)
        # stage 1: to local rank l' the rows [:, l']: (L, H, S) -> L blocks of H rows
        send = rows.transpose(0, 1).reshape(self.local * self.nodes, shard_numel)
        if self.local > 1:
            partial, bound1 = self._exchange(send, self.local, self.nodes, self.intra)  # (H, S)
        else:  # one rank per node: nothing to exchange (or quantize) within it
            partial, bound1 = send.float(), 0.0
        bound2 = 0.0
        if self.nodes > 1:
            total, bound2 = self._exchange(partial, self.nodes, 1, self.inter)  # (1, S)
        else:
            total = partial
        stages = self.max_stage_bounds
        self.max_stage_bounds = [max(stages[0], bound1), max(stages[1], bound2)]
        out = total.reshape(shard_numel)
        return Launched(out if out.dtype == buf.dtype else out.to(buf.dtype), None, full=False)

    def _exchange(
        self, send: torch.Tensor, peers: int, rows: int, group: Any
    ) -> tuple[torch.Tensor, float]:
        """Quantize ``send`` (peers * rows, S), all-to-all ``rows`` rows to each peer,
        dequantize what arrives and sum over the peers: (rows, S) fp32, and the largest
        error bound of that sum (half a step of every source's block, added up)."""
        q = quantize_rows(send, self.bits, self.block)
        codes = torch.empty_like(q.codes)
        scales = torch.empty_like(q.scales)
        comm.all_to_all_single(codes, q.codes, group=group)
        comm.all_to_all_single(scales, q.scales, group=group)
        self.bytes_sent += q.nbytes()
        got = dequantize_rows(Quantized(codes, scales, q.numel, q.bits, q.block))
        bound = float(scales.view(peers, rows, -1).sum(dim=0).max()) / 2
        return got.view(peers, rows, -1).sum(dim=0), bound  # (rows, S)


def error_bound_from(stage_bounds: list[float], nodes: int) -> float:
    """Bound on the error of any summed element, from the maxima over all ranks of
    :attr:`QuantizedReduction.max_stage_bounds`: an element of node h's rank gets the
    stage-1 error of its row on each of the ``nodes`` nodes, then one stage-2 error."""
    return nodes * stage_bounds[0] + stage_bounds[1]


def reduction_error_bound(
    per_rank_rows: list[torch.Tensor], local: int, nodes: int, bits: int, block: int
) -> torch.Tensor:
    """Bound of ``|qgZ sum - exact sum|`` on every element of every shard row.

    ``per_rank_rows[r]`` is rank r's whole bucket as (W, S) shard rows. Stage 1 adds each
    source's half step; stage 2 adds the half step of each node's (dequantized) partial
    sum, bounded here by quantizing the exact partial sum plus its stage-1 bound (the
    largest the block maximum can be).
    """
    from shardspeed.zero.zeropp.quantize import error_bound

    world = local * nodes

    def stage1(rows: list[torch.Tensor]) -> torch.Tensor:  # (W, S); no stage 1 if local 1
        if local == 1:
            return torch.zeros_like(rows[0], dtype=torch.float32)
        return sum(error_bound(r, bits, block) for r in rows)  # type: ignore[return-value]

    if nodes == 1:
        return stage1(per_rank_rows)
    bound = stage1(per_rank_rows).clone()
    for h in range(nodes):
        node_rows = [per_rank_rows[h * local + j] for j in range(local)]
        exact_partial = sum(r.float() for r in node_rows)  # (W, S)
        node_stage1 = stage1(node_rows)
        worst = exact_partial.abs() + node_stage1  # the block maxima can grow this much
        bound += error_bound(worst, bits, block)
    assert bound.shape[0] == world
    return bound
