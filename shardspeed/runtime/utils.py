"""DeepSpeed's ``deepspeed.runtime.utils``: the helpers training scripts import from it
(``set_random_seed``, ``see_memory_usage``, ``clip_grad_norm_``), with DeepSpeed's
signatures and semantics."""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Iterable
from typing import Any

import torch

from shardspeed import comm
from shardspeed.accelerator import get_accelerator
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


__all__ = ["clip_grad_norm_", "see_memory_usage", "set_random_seed"]
