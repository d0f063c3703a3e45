"""Turn a built (or meta) ragged MoE model into one expert-parallel rank's part."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from shardspeed.inference.fastgen.expert_parallel.dispatch import DISPATCHES, ExpertComm
from shardspeed.inference.fastgen.expert_parallel.placement import ExpertPlacement
from shardspeed.inference.fastgen.models.moe import SparseMoE


def moe_blocks(model: nn.Module) -> list[SparseMoE]:
    """The routed blocks of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def num_experts_of(model: nn.Module) -> int:
    """The routed experts per layer of ``model`` (0 when it has no routed layer)."""
    blocks = moe_blocks(model)
    return blocks[0].num_experts if blocks else 0


def attach_experts(
    model: Any, placement: ExpertPlacement, comm: ExpertComm, dispatch: str = "all_to_all"
) -> None:
    """Keep ``placement``'s experts in every routed layer and exchange tokens through
    ``comm`` with the ``dispatch`` strategy (a key of :data:`~.dispatch.DISPATCHES`).

    Call on the meta model, before its weights load: the other experts are never
    materialised and their checkpoint tensors are skipped.
    """
    model.place_experts(placement.local_experts)
    exchange = DISPATCHES[dispatch](placement, comm)
    for block in moe_blocks(model):
        block.exchange = exchange


def expert_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the routed experts' parameters this rank holds (router and shared expert
    excluded)."""
    seen: set[int] = set()
    total = 0
    for block in moe_blocks(model):
        for p in block.experts.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of all of ``model``'s (distinct) parameters."""
    return sum(
        p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()
    )


__all__ = [
    "attach_experts", "expert_parameter_bytes", "moe_blocks", "num_experts_of", "parameter_bytes",
]  # fmt: skip
