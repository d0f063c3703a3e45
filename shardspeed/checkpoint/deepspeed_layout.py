"""DeepSpeed 0.19's ZeRO checkpoint layout as pure functions: file names and partition math.

A tag written in DeepSpeed's layout holds, for ``dp`` data-parallel ranks::

    mp_rank_00_model_states.pt                      # stages 1/2: module, counters, shapes
    zero_pp_rank_{r}_mp_rank_00_model_states.pt     # stage 3: the same, once per rank r
    [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   # rank r's fp32 partition + state

Stages 1/2 flatten a param group's parameters back to back, pad the flat to a multiple of
``2 * dp`` elements and give rank ``r`` the ``r``-th of ``dp`` equal slices; the padding lies
at the tail, so only the last ranks' partitions hold any::

    group of 13 elements, dp 2:  [p0 p0 p0 p1 ... p1 | pad pad pad]   aligned to 16
                                  rank 0: [0, 8)       rank 1: [8, 16) (3 padding)

Stage 3 splits every parameter on its own into ``ceil(numel / dp)`` chunks (the last one
zero-padded); rank ``r``'s flat is its chunk of each parameter, in group order.

Nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DS_VERSION = "0.19.8"
"""The DeepSpeed version this layout follows (written as ``ds_version``)."""

ZERO12_MODEL_STATES = "mp_rank_00_model_states.pt"
ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor: the flat aligns to 2 * dp


def optim_states_name(dp_rank: int, bf16: bool) -> str:
    """Rank ``dp_rank``'s ZeRO optimizer file (DeepSpeed prefixes ``bf16_`` under bf16)."""
    prefix = "bf16_" if bf16 else ""
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def model_states_name(stage: int, dp_rank: int = 0) -> str:
    """The model states file: one per tag at stages 1/2, one per data-parallel rank at 3."""
    if stage == 3:
        return f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt"
    return ZERO12_MODEL_STATES


@dataclass(frozen=True)
class FlatPartition:
    """Rank ``rank``'s slice ``[start, start + size)`` of a stage-1/2 group's aligned flat;
    its last ``padding`` elements lie past the parameters."""

    rank: int
    start: int
    size: int
    padding: int


def zero12_partitions(group_numel: int, dp: int) -> list[FlatPartition]:
    """The ``dp`` equal partitions of a stage-1/2 flat group of ``group_numel`` elements."""
    alignment = ALIGNMENT_FACTOR * dp
    aligned = math.ceil(group_numel / alignment) * alignment
    size = aligned // dp
    out = []
    for rank in range(dp):
        start = rank * size
        padding = max(0, min(size, start + size - group_numel))
        out.append(FlatPartition(rank=rank, start=start, size=size, padding=padding))
    return out


def stage3_chunk(numel: int, dp: int) -> int:
    """Elements of one parameter per rank at stage 3 (the last rank's chunk is padded)."""
    return math.ceil(numel / dp)


def stage3_sub_groups(numels: list[int], dp: int, sub_group_size: int) -> list[list[int]]:
    """Indices of a param group's parameters per stage-3 sub group, as DeepSpeed splits them:
    one sub group unless the group's per-rank elements exceed ``sub_group_size``; otherwise a
    sub group closes once it holds at least ``sub_group_size`` per-rank elements."""
    chunks = [stage3_chunk(n, dp) for n in numels]
    if not numels or sub_group_size >= sum(chunks):
        return [list(range(len(numels)))]
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, chunk in enumerate(chunks):
        current.append(index)
        held += chunk
        if held >= sub_group_size or index == len(chunks) - 1:
            groups.append(current)
            current, held = [], 0
    return groups
