"""The ranks of a pipeline x tensor parallel engine and the process groups they form.

``P`` stages of ``T`` tensor-parallel ranks each; rank ``stage * T + tp_rank``, so the
caller's process (rank 0) is stage 0's tensor rank 0::

    stage 0: ranks 0 .. T-1          tensor group "fastgen_pp_stage0" (all-reduces)
    stage 1: ranks T .. 2T-1         tensor group "fastgen_pp_stage1"
    ...
    pipe t:  tensor rank t of every stage, group "fastgen_pp_pipe{t}" (rank = stage)

Every tensor rank of a stage ends its layers with the same full hidden states (each
block's all-reduce leaves the whole sum on every rank), so tensor rank ``t`` of stage
``k`` sends them to tensor rank ``t`` of stage ``k + 1`` over pipe ``t``: ``T`` sends of
``[N, hidden]`` per stage boundary instead of one, on ``T`` independent links, and no
broadcast inside the receiving stage. With ``T == 1`` this is plain pipeline
parallelism (one pipe, no tensor group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD, TensorShard
from shardspeed.inference.fastgen.tensor_parallel.group import GroupHandle, new_process_group


@dataclass(frozen=True)
class GridRank:
    """One rank's place: its stage and its tensor rank within the stage."""

    stage: int
    tp_rank: int
    num_stages: int
    tp_size: int

    @property
    def rank(self) -> int:
        return self.stage * self.tp_size + self.tp_rank

    @property
    def name(self) -> str:
        """How errors name this rank (``stage rank 1``; ``stage 1 tensor rank 0 (rank 2)``)."""
        if self.tp_size == 1:
            return f"stage rank {self.stage}"
        return f"stage {self.stage} tensor rank {self.tp_rank} (rank {self.rank})"

    @property
    def reports_results(self) -> bool:
        """The last stage's tensor rank 0 sends rank 0 each micro-batch's result."""
        return self.stage == self.num_stages - 1 and self.tp_rank == 0


def grid_ranks(num_stages: int, tp_size: int) -> list[GridRank]:
    """Every rank in global order (rank 0 first)."""
    return [GridRank(s, t, num_stages, tp_size) for s in range(num_stages) for t in range(tp_size)]


def tensor_shard(where: GridRank, handle: GroupHandle) -> TensorShard:
    """The :class:`TensorShard` a rank builds its stage with (its all-reduce via ``handle``)."""
    if where.tp_size == 1:
        return NO_SHARD
    return TensorShard(where.tp_rank, where.tp_size, handle.all_reduce)


def join_groups(
    store: dist.Store, where: GridRank, handle: GroupHandle, device: torch.device
) -> Any:
    """Join this rank's stage tensor group (into ``handle``) and its pipe; the pipe group.

    Every rank joins its tensor group first, then its pipe, so no rendezvous waits on a
    rank still blocked in another.
    """
    if where.tp_size > 1:
        handle.group = new_process_group(
            store, where.tp_rank, where.tp_size, device, name=f"fastgen_pp_stage{where.stage}"
        )
    return new_process_group(
        store, where.stage, where.num_stages, device, name=f"fastgen_pp_pipe{where.tp_rank}"
    )
