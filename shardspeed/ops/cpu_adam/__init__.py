"""Native CPU Adam/AdamW kernel (``cpu_adam.cpp``) and the choice between it and torch's.

:func:`select_backend` decides once per optimizer whether
:class:`~shardspeed.ops.adam.DeepSpeedCPUAdam` steps its fp32 CPU parameters with the
native kernel (``"native"``) or with torch's fused CPU Adam (``"torch"``):

* ``SHARDSPEED_CPU_ADAM=torch``: torch's kernel, nothing is built;
* ``SHARDSPEED_CPU_ADAM=native``: the native kernel; a failed build is an error;
* unset (or ``auto``): the native kernel when it builds, else torch's, with one log line
  saying why.

:func:`adam_step_` runs the kernel over one parameter group. Why a kernel of our own:
measured with ``benchmarks/cpu_optimizer_bench.py`` it updates in-cache shards ~2x faster
than torch's fused CPU AdamW and as fast as DeepSpeed's ``DeepSpeedCPUAdam`` (within the
few per cent a shared machine resolves; see ``docs/optimizers.md``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Literal

from torch import Tensor

from shardspeed.ops.cpu_adam import builder
from shardspeed.ops.cpu_adam.builder import CpuAdamBuildError
from shardspeed.utils.logging import log_dist, warning_once

__all__ = ["ENV_VAR", "Backend", "CpuAdamBuildError", "adam_step_", "select_backend"]

ENV_VAR = "SHARDSPEED_CPU_ADAM"
Backend = Literal["native", "torch"]
_CHOICES = ("auto", "native", "torch")


def select_backend() -> Backend:
    """The CPU Adam kernel to use, from ``SHARDSPEED_CPU_ADAM`` and whether the build works.

    Raises:
        ValueError: ``SHARDSPEED_CPU_ADAM`` is not ``auto``, ``native`` or ``torch``.
        RuntimeError: ``SHARDSPEED_CPU_ADAM=native`` but the kernel cannot be built.
    """
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not valid; allowed: {', '.join(_CHOICES)}. "
            f"Fix: unset {ENV_VAR} (auto: native kernel when it builds) or set it to "
            "'native' or 'torch'."
        )
    if choice == "torch":
        _note_once(f"DeepSpeedCPUAdam: {ENV_VAR}=torch, using torch's fused CPU Adam kernel")
        return "torch"
    try:
        builder.load_cpu_adam()
    except CpuAdamBuildError as err:
        if choice == "native":
            raise RuntimeError(
                f"{ENV_VAR}=native but the native CPU Adam kernel cannot be built: {err}\n"
                f"Fix: install a C++ compiler and ninja (`pip install ninja`), or unset {ENV_VAR} "
                "to fall back to torch's fused CPU Adam."
            ) from err
        warning_once(
            f"DeepSpeedCPUAdam: falling back to torch's fused CPU Adam kernel (slower on "
            f"in-cache shards) because the native kernel cannot be built: {err}. Set "
            f"{ENV_VAR}=torch to skip the build attempt."
        )
        return "torch"
    _note_once("DeepSpeedCPUAdam: using the native CPU Adam kernel")
    return "native"


@functools.cache
def _note_once(message: str) -> None:
    """Log ``message`` once per process, on rank 0 (a fallback warning goes to every rank)."""
    log_dist(message)


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> None:
    """One in-place Adam/AdamW update of fp32 contiguous CPU tensors (native kernel).

    ``steps`` are the 0-dim step counts of torch's Adam state; the kernel adds one to each
    before using it (torch's order). Every tensor is checked (dtype, device, contiguity,
    size) before any is changed; a mismatch raises ``RuntimeError``. The GIL is released
    while the kernel runs.

    Raises:
        CpuAdamBuildError: the kernel cannot be built (see :func:`select_backend`).
    """
    builder.load_cpu_adam().adam_step_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        steps,
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw_mode),
        bool(bias_correction),
    )
