"""The batch-size search behind elastic training: pure integer math, no torch.

An elastic job wants one global batch size ``B`` that stays the same whatever number of
GPUs the scheduler gives it, so that scaling up or down does not change convergence. ``B``
works on ``n`` GPUs when some allowed micro batch ``m`` gives a whole number of accumulation
steps: ``m * n`` divides ``B``. The search (DeepSpeed's, versions 0.1 and 0.2):

1. Bases: each micro batch and their least common multiple.
2. Candidates: each base scaled by the largest highly composite number (HCN) that keeps it
   within ``max_train_batch_size``. HCNs have more divisors than any smaller number, so the
   scaled batch divides evenly for many GPU counts.
3. For each candidate, count the GPU counts in ``[min_gpus, max_gpus]`` that it works on;
   keep the candidate with the most (ties: the larger batch, or the smaller one when
   ``prefer_larger_batch`` is false).

Version 0.2 runs the same search per node: the batch cap and GPU range are divided by the
data-parallel ranks per node (``num_gpus_per_node / model_parallel_size``) and the result
scaled back. When the current world size is not in the resulting list, it falls back to the
largest multiple of ``micro * dp`` under the cap, valid for that world size only.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from fractions import Fraction

from shardspeed.elasticity.config import ElasticityConfigError, ElasticityError

HCN_LIST: tuple[int, ...] = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040,
    7560, 10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320,
    221760, 277200, 332640, 498960, 554400, 665280, 720720,
)  # fmt: skip
"""The first 38 highly composite numbers (OEIS A002182). A base is never scaled by more
than 720720, the last of them, which bounds the search (as in DeepSpeed)."""


def largest_hcn_at_most(value: int) -> int:
    """The largest number of :data:`HCN_LIST` that is ``<= value`` (``value >= 1``)."""
    return HCN_LIST[max(bisect.bisect_right(HCN_LIST, value) - 1, 0)]


def get_candidate_batch_sizes(
    base_list: Sequence[int], max_acceptable_batch_size: int
) -> list[int]:
    """Each base scaled by the largest HCN keeping it ``<= max_acceptable_batch_size``.

    A base above the cap is skipped (scaling only grows it). Returns the distinct candidates,
    ascending.
    """
    candidates = set()
    for base in base_list:
        if base <= max_acceptable_batch_size:
            candidates.add(base * largest_hcn_at_most(max_acceptable_batch_size // base))
    return sorted(candidates)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def get_valid_gpus(
    batch_size: int, micro_batches: Sequence[int], min_valid_gpus: int, max_valid_gpus: int
) -> list[int]:
    """GPU counts ``n`` in ``[min_valid_gpus, max_valid_gpus]`` that ``batch_size`` works on.

    ``n`` works when ``m * n`` divides ``batch_size`` for some micro batch ``m``, i.e. ``n``
    divides ``batch_size // m``. Sorted ascending.
    """
    valid: set[int] = set()
    for micro in set(micro_batches):
        if batch_size % micro == 0:
            per_micro = batch_size // micro
            valid.update(d for d in _divisors(per_micro) if min_valid_gpus <= d <= max_valid_gpus)
    return sorted(valid)


def get_best_candidates(
    candidate_batch_sizes: Sequence[int],
    micro_batches: Sequence[int],
    min_gpus: int,
    max_gpus: int,
    prefer_larger: bool,
) -> tuple[int, list[int]]:
    """The candidate that works on the most GPU counts, and those counts.

    Ties go to the larger batch (``prefer_larger``) or the smaller one. A candidate must beat
    the starting point "smallest micro batch, no GPU counts" strictly, so when no candidate
    works on any count the answer is that starting point: ``(min(micro_batches), [])``, or
    with ``prefer_larger`` the largest candidate above it.
    """
    best_batch = min(micro_batches)
    best_gpus: list[int] = []
    for batch_size in candidate_batch_sizes:
        gpus = get_valid_gpus(batch_size, micro_batches, min_gpus, max_gpus)
        bigger = batch_size > best_batch if prefer_larger else batch_size < best_batch
        if len(gpus) > len(best_gpus) or (len(gpus) == len(best_gpus) and bigger):
            best_batch, best_gpus = batch_size, gpus
    return best_batch, best_gpus


def compatible_gpus_v01(
    micro_batches: Sequence[int],
    max_acceptable_batch_size: int,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    prefer_larger: bool = True,
) -> tuple[int, list[int]]:
    """Version 0.1: ``(batch_size, valid_gpu_counts)`` over GPUs (see the module docstring).

    ``min_gpus`` 0/None means 1; ``max_gpus`` 0/None means ``cap // min(micro_batches)``.

    Raises:
        ElasticityConfigError: if a micro batch is larger than the cap.
    """
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    too_big = [m for m in micro_batches if m > max_acceptable_batch_size]
    if too_big:
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes {too_big} exceed max_train_batch_size "
            f"({max_acceptable_batch_size}). Allowed: micro batches <= max_train_batch_size. "
            "Fix: raise max_train_batch_size or drop the larger micro batches.",
            "micro_batch_sizes",
        )
    bases = [*micro_batches, math.lcm(*micro_batches)]
    candidates = get_candidate_batch_sizes(bases, max_acceptable_batch_size)
    return get_best_candidates(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def pick_micro_batch(
    batch_size: int | Fraction, world_size: int, micro_batches: Sequence[int], prefer_larger: bool
) -> int | None:
    """Version 0.2's micro batch for ``batch_size`` on ``world_size`` ranks.

    Among the micro batches dividing ``batch_size // world_size``: the largest with
    ``prefer_larger``, else the first in the user's order. None when none divides.
    """
    per_rank = batch_size // world_size
    fitting = [m for m in micro_batches if per_rank % m == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def compatible_gpus_v02(
    micro_batches: Sequence[int],
    max_acceptable_batch_size: int,
    current_num_gpus: int,
    min_gpus: int = 1,
    max_gpus: int = 10000,
    prefer_larger: bool = True,
    num_gpus_per_node: int = 1,
    model_parallel_size: int = 1,
) -> tuple[int, list[int], int | None]:
    """Version 0.2: ``(batch_size, valid_dp_world_sizes, micro_batch)`` searched per node.

    Raises:
        ElasticityError: if ``num_gpus_per_node`` is not a multiple of ``model_parallel_size``.
        ElasticityConfigError: if a micro batch exceeds the per-node batch cap.
    """
    if num_gpus_per_node % model_parallel_size != 0:
        raise ElasticityError(
            f"elasticity.num_gpus_per_node ({num_gpus_per_node}) must be a multiple of "
            f"elasticity.model_parallel_size ({model_parallel_size}) for version 0.2. Fix: "
            "set num_gpus_per_node to the GPUs of one node and model_parallel_size to a "
            "divisor of it.",
            "model_parallel_size",
        )
    dp_per_node = num_gpus_per_node // model_parallel_size
    node_cap = max_acceptable_batch_size // dp_per_node
    too_big = [m for m in micro_batches if m > node_cap]
    if too_big:
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes {too_big} exceed the per-node batch cap "
            f"max_train_batch_size // (num_gpus_per_node // model_parallel_size) = "
            f"{max_acceptable_batch_size} // {dp_per_node} = {node_cap}. Fix: raise "
            "max_train_batch_size or drop the larger micro batches.",
            "micro_batch_sizes",
        )
    node_batch, valid_nodes = compatible_gpus_v01(
        micro_batches,
        node_cap,
        min_gpus // num_gpus_per_node,
        max_gpus // num_gpus_per_node,
        prefer_larger=prefer_larger,
    )
    batch_size = node_batch * dp_per_node
    valid_dp = [nodes * dp_per_node for nodes in valid_nodes]
    if current_num_gpus // model_parallel_size in valid_dp:
        micro = pick_micro_batch(batch_size, current_num_gpus, micro_batches, prefer_larger)
        return batch_size, valid_dp, micro

    # The current size is not in the list: the largest multiple of micro * dp under the cap,
    # for this size only (dp may be fractional when the size is not a whole number of nodes).
    current_dp = Fraction(current_num_gpus * dp_per_node, num_gpus_per_node)
    fallbacks = [
        math.floor(max_acceptable_batch_size / (m * current_dp)) * m * current_dp
        for m in micro_batches
    ]
    fallback = max(fallbacks) if prefer_larger else min(fallbacks)
    micro = pick_micro_batch(fallback, current_num_gpus, micro_batches, prefer_larger)
    return int(fallback), [int(current_dp)], micro
