"""Which attention heads each rank of a sequence group owns during Ulysses attention (pure math).

Between the two all-to-alls every rank holds the *full* sequence for a slice of the heads.
Query heads must land on the rank that holds their key/value head (grouped-query attention:
query head ``i`` reads KV head ``i // group_size``), so heads are dealt out by KV group::

    num_q_heads=8, num_kv_heads=2 (group_size 4), 2 ranks:   rank 0: q 0-3, kv 0
                                                             rank 1: q 4-7, kv 1

When a rank would get no whole KV head (fewer KV heads than ranks), each KV head is
*replicated* ``kv_replicas`` times before the all-to-all and its query group split across the
copies; autograd sums the copies' gradients back into the one head::

    num_q_heads=8, num_kv_heads=2, 4 ranks: kv_replicas=2 -> kv heads [0, 0, 1, 1]
                                            rank r: q heads 2r, 2r+1 and one kv copy

When neither an even split nor replication fits, heads are split unevenly by KV group (as
DeepSpeed does for, e.g., 6 heads on 4 ranks: 2, 2, 1, 1). What is impossible (a rank
without a query head, query heads that are not a multiple of KV heads) raises a
``ValueError`` that lists the sequence-parallel sizes that would work.

Nothing here imports ``torch.distributed``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadLayout:
    """How ``num_q_heads`` query and ``num_kv_heads`` KV heads are dealt to the ranks.

    ``q_counts[r]`` / ``kv_counts[r]`` are rank ``r``'s head counts during local attention
    (KV counts after replication); each rank's heads are one contiguous range, in rank order.
    """

    num_q_heads: int
    num_kv_heads: int
    kv_replicas: int
    q_counts: tuple[int, ...]
    kv_counts: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.q_counts)

    @property
    def is_even(self) -> bool:
        """Every rank holds the same number of heads (one plain all-to-all)."""
        return len(set(self.q_counts)) == 1 and len(set(self.kv_counts)) == 1

    def q_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s query heads as ``[start, stop)``."""
        start = sum(self.q_counts[:rank])
        return start, start + self.q_counts[rank]

    def kv_range(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s KV heads (indices into the replicated KV heads) as ``[start, stop)``."""
        start = sum(self.kv_counts[:rank])
        return start, start + self.kv_counts[rank]


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Ulysses attention: {name} must be an int >= 1, got {value!r}")
    return value


def _near_even(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` counts differing by at most one, larger first."""
    base, extra = divmod(total, parts)
    return tuple(base + 1 if r < extra else base for r in range(parts))


def _try_plan(num_q_heads: int, num_kv_heads: int, world_size: int) -> HeadLayout | str:
    """The layout, or the reason there is none."""
    if num_q_heads % num_kv_heads:
        return (
            f"{num_q_heads} query heads are not a multiple of {num_kv_heads} key/value heads, "
            "so they do not form grouped-query attention groups"
        )
    if num_q_heads < world_size:
        return f"{num_q_heads} query heads cannot give each of {world_size} ranks one head"
    group_size = num_q_heads // num_kv_heads
    # Smallest replication that makes the KV heads divide evenly over the ranks; it must
    # also split each query group into whole pieces.
    replicas = world_size // math.gcd(num_kv_heads, world_size)
    if group_size % replicas == 0:
        kv_total = num_kv_heads * replicas
        kv_counts = (kv_total // world_size,) * world_size
        q_counts = (num_q_heads // world_size,) * world_size
        return HeadLayout(num_q_heads, num_kv_heads, replicas, q_counts, kv_counts)
    if num_kv_heads >= world_size:
        kv_counts = _near_even(num_kv_heads, world_size)
        q_counts = tuple(c * group_size for c in kv_counts)
        return HeadLayout(num_q_heads, num_kv_heads, 1, q_counts, kv_counts)
    return (
        f"{num_kv_heads} key/value heads are fewer than {world_size} ranks, and replicating each "
        f"{replicas}x would split its {group_size} query heads into unequal pieces"
    )


@functools.lru_cache(maxsize=64)
def plan_heads(num_q_heads: int, num_kv_heads: int, world_size: int) -> HeadLayout:
    """The head layout for ``world_size`` sequence ranks (see the module docstring)."""
    _check_count("num_q_heads", num_q_heads)
    _check_count("num_kv_heads", num_kv_heads)
    _check_count("sequence-parallel size", world_size)
    plan = _try_plan(num_q_heads, num_kv_heads, world_size)
    if isinstance(plan, HeadLayout):
        return plan
    valid = [
        p
        for p in range(1, num_q_heads + 1)
        if isinstance(_try_plan(num_q_heads, num_kv_heads, p), HeadLayout)
    ]
    raise ValueError(
        f"Ulysses attention cannot split num_q_heads={num_q_heads}, "
        f"num_kv_heads={num_kv_heads} over a sequence-parallel group of {world_size} ranks: "
        f"{plan}. Sequence-parallel sizes that work for these heads: {valid}."
    )
