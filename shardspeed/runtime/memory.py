"""Per-rank memory accounting for the engine (``engine.memory_breakdown()``)."""

from __future__ import annotations

from typing import Any

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of tensors held in an optimizer's state (steps counters included)."""
    if optimizer is None:
        return 0
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _nbytes(value)
    return total


def memory_breakdown(engine: Any) -> dict[str, int]:
    """Bytes held on this rank: params, grads, master_params, optimizer_state, buffers, total."""
    flat_ids = {id(p) for g in engine.flat_groups for p in g.params}
    out = {"params": 0, "grads": 0, "master_params": 0}
    for group in engine.flat_groups:
        for key, value in group.storage_bytes().items():
            out[key] += value
    seen: set[int] = set()
    for p in engine.module.parameters():
        if id(p) in flat_ids or id(p) in seen:
            continue
        seen.add(id(p))
        out["params"] += _nbytes(p)  # frozen parameters
    out["optimizer_state"] = optimizer_state_bytes(engine.basic_optimizer)
    out["buffers"] = sum(_nbytes(b) for b in engine.module.buffers())
    out["total"] = sum(out.values())
    return out
