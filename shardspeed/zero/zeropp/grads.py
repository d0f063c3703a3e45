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

Overlap with backward. :meth:`QuantizedReduction.launch` (called by the reducer from the
grad hook that completes a bucket) quantizes the bucket, starts stage 1's two all-to-alls
(codes, scales) with ``async_op=True`` and returns at once, like the default asynchronous
reduce-scatter. Stage 2 needs stage 1's result, so it cannot start at launch; and where it
starts is constrained, because every rank must issue its collectives in the same order
(a collective is matched by its position in each group's sequence, not by its bucket).
Whether a handle's collective has finished differs between ranks, so nothing is ever
issued *because* something finished. Stage 2 of a bucket is issued at exactly two points,
both reached in the same order on every rank:

1. the next :meth:`~QuantizedReduction.launch` of the same reduction, right after that
   bucket's own stage 1 is started: it waits for the previous bucket's stage 1,
   dequantizes and sums it, and starts its stage 2. The reducer launches buckets in one
   fixed global order on every rank, so the stage-2 calls made here are in that order too;
2. :meth:`QgzWork.wait` of a bucket still in stage 1 (only the last bucket launched
   through a reduction can be): the reducer's ``flush`` waits its in-flight buckets in
   launch order on every rank.

:meth:`QgzWork.is_completed` says False while a stage 2 is still to be issued, so the
reducer's early completion of finished buckets (optimizer offload streams them to the
host during backward), which does depend on per-rank timing, only ever waits handles whose
collectives are all issued. With buckets 0..n of one reduction every rank therefore issues
``s1(0) s1(1) s2(0) s1(2) s2(1) ... s1(n)`` during backward and ``s2(n)`` at flush (with
one node: only the stage-1 calls). The numbers are those of the synchronous order (launch
then wait each bucket): the same quantization of the same tensors and the same sums.
Stage 2 carries the comms-logger tag of its own bucket, though it is issued while the next
one launches. ``zero_optimization.overlap_comm: false`` makes the reducer launch every
bucket at flush instead, so nothing overlaps backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspeed import comm
from shardspeed.zero.grad_reduction import Launched
from shardspeed.zero.zeropp.quantize import GRAD_BLOCK, Quantized, dequantize_rows, quantize_rows

QGZ_BITS = 4


@dataclass
class _Exchange:
    """One stage in flight: the two all-to-alls of a quantized ``(peers * rows, S)`` send,
    into ``codes`` / ``scales``."""

    codes: torch.Tensor
    scales: torch.Tensor
    works: list[Any]
    numel: int
    bits: int
    block: int
    peers: int
    rows: int

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def finish(self) -> tuple[torch.Tensor, float]:
        """Wait, dequantize what arrived and sum over the peers: (rows, S) fp32, and the
        largest error bound of that sum (half a step of every source's block, added up)."""
        for work in self.works:
            work.wait()
        got = dequantize_rows(Quantized(self.codes, self.scales, self.numel, self.bits, self.block))
        bound = float(self.scales.view(self.peers, self.rows, -1).sum(dim=0).max()) / 2
        return got.view(self.peers, self.rows, -1).sum(dim=0), bound  # (rows, S)


class QgzWork:
    """The handle of one launched qgZ reduction (the ``work`` of its :class:`Launched`).

    ``wait()`` leaves this rank's summed shard in ``out``; ``is_completed()`` is True once
    ``wait()`` would issue no collective and not block (module docstring: ordering).
    """

    def __init__(self, reduction: QuantizedReduction, out: torch.Tensor, tag: str | None) -> None:
        self.reduction = reduction
        self.out = out  # (S,) in the bucket's dtype: the summed shard after wait()
        self.tag = tag
        self.stage1: _Exchange | None = None
        self.stage2: _Exchange | None = None
        self.done = False

    @property
    def awaits_stage2(self) -> bool:
        """Stage 1 is in flight and a stage 2 must follow it (not issued yet)."""
        return self.stage1 is not None and self.reduction.nodes > 1

    def is_completed(self) -> bool:
        if self.done:
            return True
        if self.stage1 is not None:  # stage 2 (if any) is still to be issued: not done
            return not self.awaits_stage2 and self.stage1.is_completed()
        return self.stage2 is not None and self.stage2.is_completed()

    @torch.no_grad()
    def advance(self) -> None:
        """Finish stage 1 and, across nodes, start stage 2 (a collective: only at the
        points the module docstring lists). No-op once stage 1 is done."""
        if self.stage1 is None:
            return
        partial, bound1 = self.stage1.finish()  # (H, S)
        self.stage1 = None
        self.reduction.note_bounds(bound1, 0.0)
        if self.reduction.nodes > 1:
            with comm.set_current_tag(self.tag or "qgz stage 2"):
                self.stage2 = self.reduction.start_exchange(
                    partial, self.reduction.nodes, 1, self.reduction.inter
                )
        else:
            self._store(partial)

    @torch.no_grad()
    def wait(self) -> None:
        if self.done:
            return
        self.advance()
        if self.stage2 is not None:
            total, bound2 = self.stage2.finish()  # (1, S)
            self.stage2 = None
            self.reduction.note_bounds(0.0, bound2)
            self._store(total)

    def _store(self, total: torch.Tensor) -> None:
        self.out.copy_(total.reshape(-1))  # fp32 sum, rounded to the bucket's dtype
        self.done = True


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
        self._awaiting_stage2: list[QgzWork] = []  # launched, stage 2 not yet issued

    @torch.no_grad()
    def launch(self, buf: torch.Tensor, shard: tuple[int, int] | None) -> Launched:
        """Start the reduction of ``buf`` (stage 1, asynchronous) and the stage 2 of the
        bucket launched before it; ``out`` holds the summed shard once ``work`` is waited."""
        if self.world_size == 1:
            return Launched(buf, None, full=True)
        if shard is None:  # every rank keeps the whole bucket: not a qgZ case
            work = comm.all_reduce(buf, group=self.intra, async_op=True)
            return Launched(buf, work, full=True)
        shard_numel = shard[1] - shard[0]
        out = torch.empty(shard_numel, dtype=buf.dtype, device=buf.device)
        handle = QgzWork(self, out, comm.current_tag())
        rows = buf.view(self.nodes, self.local, shard_numel)  # (H, L, S)
        # stage 1: to local rank l' the rows [:, l']: (L, H, S) -> L blocks of H rows
        send = rows.transpose(0, 1).reshape(self.local * self.nodes, shard_numel)
        if self.local > 1:
            handle.stage1 = self.start_exchange(send, self.local, self.nodes, self.intra)
        else:  # one rank per node: nothing to exchange (or quantize) within it
            handle.stage2 = self.start_exchange(send, self.nodes, 1, self.inter)
        for earlier in self._awaiting_stage2:  # launch order: the same on every rank
            earlier.advance()
        self._awaiting_stage2 = [handle] if handle.awaits_stage2 else []
        return Launched(out, handle, full=False)

    def reduce(self, buf: torch.Tensor, shard: tuple[int, int]) -> torch.Tensor:
        """The summed shard now: :meth:`launch` and wait (for callers outside the reducer)."""
        launched = self.launch(buf, shard)
        if launched.work is not None:
            launched.work.wait()
        return launched.out

    def start_exchange(self, send: torch.Tensor, peers: int, rows: int, group: Any) -> _Exchange:
        """Quantize ``send`` (peers * rows, S) and start the all-to-alls that send ``rows``
        rows to each peer."""
        q = quantize_rows(send, self.bits, self.block)
        codes = torch.empty_like(q.codes)
        scales = torch.empty_like(q.scales)
        works = [
            comm.all_to_all_single(codes, q.codes, group=group, async_op=True),
            comm.all_to_all_single(scales, q.scales, group=group, async_op=True),
        ]
        self.bytes_sent += q.nbytes()
        return _Exchange(codes, scales, works, q.numel, q.bits, q.block, peers, rows)

    def note_bounds(self, stage1: float, stage2: float) -> None:
        stages = self.max_stage_bounds
        self.max_stage_bounds = [max(stages[0], stage1), max(stages[1], stage2)]


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
