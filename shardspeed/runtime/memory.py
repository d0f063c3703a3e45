"""Per-rank memory accounting for the engines (``engine.memory_breakdown()``).

Categories (bytes held in memory by this rank, wherever it is): ``params``, ``grads``,
``master_params``, ``optimizer_state``, ``buffers``, ``swap_buffers`` (NVMe staging
buffers), and their sum ``total``. With offload, part of that total is in host memory
rather than on the accelerator; the breakdown says how much:

* ``host``: bytes of ``total`` that offload keeps in host memory (masters, optimizer
  state, host gradient copies, parameter shards, swap buffers);
* ``device``: ``total - host``;
* ``nvme``: bytes in this rank's swap files (not part of ``total``).

State swapped to NVMe is not in memory between steps, so it counts under ``nvme`` only.
"""

from __future__ import annotations

from typing import Any

import torch

CATEGORIES = ("params", "grads", "master_params", "optimizer_state", "buffers", "swap_buffers")


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
    """Bytes held on this rank by category, plus ``total``, ``host``, ``device``, ``nvme``.

    Works for every engine with ``flat_groups`` (each with ``storage_bytes()``), a
    ``module``, a ``basic_optimizer`` and an ``offload`` runtime.
    """
    out = dict.fromkeys(CATEGORIES, 0)
    host = 0
    managed: set[int] = set()
    for group in engine.flat_groups:
        managed |= {id(p) for p in group.params}
        for key, value in group.storage_bytes().items():
            if key == "host":
                host += value
            else:
                out[key] += value
    seen: set[int] = set()
    for p in engine.module.parameters():
        if id(p) in managed or id(p) in seen:
            continue
        seen.add(id(p))
        out["params"] += _nbytes(p)  # frozen parameters, kept whole on every rank
    out["optimizer_state"] = optimizer_state_bytes(engine.basic_optimizer)
    out["buffers"] = sum(_nbytes(b) for b in engine.module.buffers())
    offload = getattr(engine, "offload", None)
    swap = offload.storage_bytes() if offload is not None else {"swap_buffers": 0, "nvme": 0}
    out["swap_buffers"] = swap["swap_buffers"]
    if offload is not None and offload.offload_optimizer:
        host += out["optimizer_state"]  # the optimizer runs on the host masters
    host += out["swap_buffers"]
    out["total"] = sum(out[k] for k in CATEGORIES)
    out["host"] = host
    out["device"] = out["total"] - host
    out["nvme"] = swap["nvme"]
    return out
