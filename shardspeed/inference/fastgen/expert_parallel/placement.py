"""Which experts each expert-parallel rank holds, and which tokens it dispatches (pure math).

Rank ``r`` of ``E`` holds the contiguous experts ``[r * n / E, (r + 1) * n / E)`` of
every routed layer (DeepSpeed-MoE's placement), so the owner of expert ``e`` is
``e // (n / E)``. The dense parts are replicated, so every rank holds the same
``N`` tokens; each dispatches only its slice of them (:func:`token_bounds`: the first
``N % E`` slices one token longer), and the slices are gathered back after the
experts ran::

    ep 2, 8 experts, N = 5 tokens
    rank 0: experts 0..3, tokens 0..2      rank 1: experts 4..7, tokens 3..4

Nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_expert_layout(
    num_experts: int,
    expert_parallel: int,
    tensor_parallel: int = 1,
    world_size: int | None = None,
    where: str = "expert_parallel",
) -> None:
    """``ValueError`` naming the numbers unless ``num_experts`` splits over ``expert_parallel``
    ranks and ``expert_parallel x tensor_parallel`` is the ``world_size`` (when given)."""
    if (
        not isinstance(expert_parallel, int)
        or isinstance(expert_parallel, bool)
        or expert_parallel < 1
    ):
        raise ValueError(f"{where}={expert_parallel!r} must be an int >= 1.")
    if num_experts < 1:
        raise ValueError(
            f"{where}={expert_parallel} needs a mixture-of-experts model, but this one has no "
            "routed experts (num_experts=0); use expert_parallel=1 (or tensor_parallel)."
        )
    if num_experts % expert_parallel:
        raise ValueError(
            f"{where}={expert_parallel} does not divide the model's num_experts={num_experts} "
            f"(each rank must hold num_experts / {where} whole experts); use {where} in "
            f"{_divisors(num_experts)}."
        )
    if world_size is not None and expert_parallel * tensor_parallel != world_size:
        raise ValueError(
            f"{where}={expert_parallel} x tensor_parallel={tensor_parallel} = "
            f"{expert_parallel * tensor_parallel} ranks, but the world has {world_size}; "
            f"launch {expert_parallel * tensor_parallel} ranks or choose degrees whose product "
            f"is {world_size}."
        )


@dataclass(frozen=True)
class ExpertPlacement:
    """Rank ``rank`` of ``ep_size`` expert-parallel ranks over ``num_experts`` experts."""

    num_experts: int
    ep_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        check_expert_layout(self.num_experts, self.ep_size)
        if not 0 <= self.rank < self.ep_size:
            raise ValueError(f"ExpertPlacement rank={self.rank} must be in [0, {self.ep_size}).")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def experts_of(self, rank: int) -> range:
        """The global expert ids rank ``rank`` holds."""
        n = self.experts_per_rank
        return range(rank * n, (rank + 1) * n)

    @property
    def local_experts(self) -> range:
        return self.experts_of(self.rank)

    def owner(self, expert: int) -> int:
        """The rank holding global expert ``expert``."""
        return expert // self.experts_per_rank


def token_bounds(num_tokens: int, ep_size: int) -> list[int]:
    """``ep_size + 1`` offsets: rank ``r`` dispatches tokens ``[b[r], b[r + 1])``."""
    base, extra = divmod(num_tokens, ep_size)
    bounds = [0]
    for r in range(ep_size):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


def describe_placement(placement: ExpertPlacement, num_moe_layers: int) -> str:
    """One line per rank: which experts it holds (for the start-up log)."""
    ranks = "; ".join(
        f"rank {r}: experts {placement.experts_of(r).start}..{placement.experts_of(r).stop - 1}"
        for r in range(placement.ep_size)
    )
    return (
        f"{placement.num_experts} experts in each of {num_moe_layers} routed layers over "
        f"{placement.ep_size} ranks ({ranks})"
    )
