"""DeepSpeed's ``deepspeed.runtime.utils``: the helpers training scripts import from it
(``set_random_seed``, ``see_memory_usage``, ``clip_grad_norm_``, ``partition_uniform``,
``partition_balanced``), with DeepSpeed's signatures and semantics."""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from shardspeed import comm
from shardspeed.accelerator import get_accelerator
from shardspeed.parallel.pipeline import partition as pipeline_partition
from shardspeed.utils.logging import log_dist


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy (when installed) and torch (every device)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional
        pass
    else:
        numpy.random.seed(seed % 2**32)  # numpy accepts only 32-bit seeds
    torch.manual_seed(seed % 2**63)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log device and host memory on rank 0; a no-op unless ``force`` (as in DeepSpeed),
    then resets the device's peak counters."""
    if not force:
        return
    gc.collect()  # report what is really held
    accel = get_accelerator()
    gib = 1024**3
    host = ""
    try:
        import psutil
    except ImportError:
        pass
    else:
        vm = psutil.virtual_memory()
        host = (
            f" | CPU virtual memory: used = {(vm.total - vm.available) / gib:.2f} GB, {vm.percent}%"
        )
    log_dist(
        f"{message} | MA {accel.memory_allocated() / gib:.2f} GB "
        f"Max_MA {accel.max_memory_allocated() / gib:.2f} GB "
        f"CA {accel.memory_reserved() / gib:.2f} GB "
        f"Max_CA {accel.max_memory_reserved() / gib:.2f} GB{host}",
        ranks=[0],
    )
    accel.reset_peak_memory_stats()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2,
    mpu: Any = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place to a total ``norm_type`` norm of at most
    ``max_norm``; returns the total norm (before clipping).

    As DeepSpeed: with a Megatron-style ``mpu`` the norm is combined over its model-parallel
    group (replicated parameters counted once, by model-parallel rank 0), and the result is
    averaged over the data-parallel group, so every rank clips by the same norm.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    device = params[0].grad.device
    distributed = comm.is_initialized()
    mp_group = mpu.get_model_parallel_group() if mpu is not None else None
    if norm_type == math.inf:
        total = torch.stack([p.grad.detach().abs().max().float() for p in params]).max()
        if distributed and mp_group is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mp_group)
    else:
        counted = [
            p
            for p in params
            if mpu is None
            or mpu.get_model_parallel_rank() == 0
            or getattr(p, "model_parallel", False)
            or getattr(p, "tensor_model_parallel", False)
        ]
        norms = [p.grad.detach().float().norm(norm_type) for p in counted]
        total = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)
        if distributed and mp_group is not None:
            comm.all_reduce(total, group=mp_group)
        total = total.pow(1.0 / norm_type)
    if distributed:  # average over data-parallel ranks (they differ with MoE parameters)
        dp_group = mpu.get_data_parallel_group() if mpu is not None else None
        total = total / comm.get_world_size(group=dp_group)
        comm.all_reduce(total, group=dp_group)
    total = total.to(device)
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(clip_coef.to(p.grad.device))
    return total


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``num_items`` items, as even as
    possible (the first parts one item larger); ``parts[i]:parts[i + 1]`` is part ``i``.

    As DeepSpeed, with fewer items than parts the first ``num_items`` parts hold one item
    each and the rest are empty (the pipeline's own splitter refuses that case).
    """
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    return pipeline_partition.partition_uniform(num_items, num_parts)


def partition_balanced(weights: Sequence[float], num_parts: int, eps: float = 1e-3) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``weights`` with the smallest spread
    between the heaviest and the lightest part (DeepSpeed 0.19.8's rule and tie-breaking:
    among equal spreads the last cut wins).

    ``eps`` is the tolerance of DeepSpeed's older bisection version of this function; it is
    accepted for scripts written against that signature and not needed by this exact
    dynamic program. With no more weights than parts the split is :func:`partition_uniform`.
    (The pipeline's ``partition_method="parameters"`` minimises the heaviest part instead:
    :func:`shardspeed.parallel.pipeline.partition.partition_balanced`.)
    """
    del eps  # see the docstring
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    # best[i][j]: (spread, heaviest, lightest) of the best split of weights[:i] into j parts
    heaviest = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    lightest = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    spread = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    cut = [[0] * (num_parts + 1) for _ in range(n + 1)]
    heaviest[0][0] = spread[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):  # the last part is weights[k:i]
                last = prefix[i] - prefix[k]
                high = max(heaviest[k][j - 1], last)
                low = min(lightest[k][j - 1], last)
                cost = high - low  # inf - inf is nan: never taken, as in DeepSpeed
                if spread[i][j] >= cost:
                    spread[i][j], heaviest[i][j], lightest[i][j], cut[i][j] = cost, high, low, k
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]


__all__ = [
    "clip_grad_norm_",
    "partition_balanced",
    "partition_uniform",
    "see_memory_usage",
    "set_random_seed",
]
