"""Fused CPU kernels for the decoder layer's elementwise steps (``fused_ops.cpp``).

RMSNorm (with the residual add before it), rotate-half RoPE and the gated MLP's
``silu(gate) * up`` each take several eager torch kernels and temporaries per layer (and
greedy sampling's row argmax a few passes over the logits); on a
CPU at serving batch sizes they cost about as much as a small matmul. These run each step
in one pass, keeping the eager formulas' roundings (see the C++ file's header for which
results are bitwise torch's). The kernel is JIT-built on first use and cached, like the
CPU attention kernel (:func:`shardspeed.ops.cpu_adam.builder.load_extension`).

The model layers call :func:`active` for a tensor: True on CPU outside autograd and
``torch.compile`` when the kernel loads and :func:`set_enabled` has not switched it off
(``SHARDSPEED_FASTGEN_FUSED_CPU=0`` does the same for a process). A build failure is
logged once and the eager ops are used.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

SOURCE = Path(__file__).with_name("fused_ops.cpp")
_PREFIX = "shardspeed_fastgen_fused"
_ENV = "SHARDSPEED_FASTGEN_FUSED_CPU"
_state: dict[str, Any] = {"enabled": None, "loaded": None, "module": None}


def _module() -> ModuleType:
    module = _state["module"]
    if module is None:  # built or loaded once; later calls skip the builder's lock
        from shardspeed.ops.cpu_adam.builder import load_extension

        module = _state["module"] = load_extension(SOURCE, _PREFIX, "FastGen's fused CPU kernels")
    return module


def set_enabled(enabled: bool | None) -> None:
    """Switch the fused kernels on or off for this process (None: back to the default,
    on unless ``SHARDSPEED_FASTGEN_FUSED_CPU=0``, read again at the next use)."""
    _state["enabled"] = enabled


def _enabled() -> bool:
    """:func:`set_enabled`'s choice, else the environment's (read once per process)."""
    if _state["enabled"] is None:
        value = os.environ.get(_ENV, "1").strip().lower()
        if value not in ("0", "1", "false", "true", "off", "on"):
            raise ValueError(
                f"{_ENV}={value!r} is not understood; set it to 1 (fused CPU kernels, the "
                "default) or 0 (eager torch ops)."
            )
        _state["enabled"] = value in ("1", "true", "on")
    return bool(_state["enabled"])


def kernel_available() -> bool:
    """Whether the kernel builds and loads in this process (logged once if it does not)."""
    if _state["loaded"] is None:
        from shardspeed.ops.cpu_adam.builder import NativeBuildError

        try:
            _module()
            _state["loaded"] = True
        except NativeBuildError as err:
            _state["loaded"] = False
            logger.warning("FastGen's fused CPU kernels are unavailable, using torch ops: %s", err)
    return bool(_state["loaded"])


def active(x: torch.Tensor) -> bool:
    """Whether a layer should use the fused kernels for ``x``: a CPU tensor, no autograd
    graph to record, not being traced by ``torch.compile``, enabled, and the kernel loads.

    Called several times per layer per step, so the common answer costs a few attribute
    reads: the switch and the build outcome are resolved once.
    """
    if not (_state["enabled"] and _state["loaded"]):
        if not (_enabled() and kernel_available()):
            return False
    if not x.is_cpu or (x.requires_grad and torch.is_grad_enabled()):
        return False
    return not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[N, hidden]`` (rows contiguous): ``offset=0`` is
    ``weight * (x / rms).to(dtype)``, otherwise ``((x / rms) * (offset + weight)).to(dtype)``."""
    return _module().rms_norm(x, weight, float(eps), float(offset))


def add_rms_norm(
    x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + a`` rounded to their dtype, in one pass."""
    s, out = _module().add_rms_norm(x, a, weight, float(eps), float(offset))
    return s, out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x`` ``[N, heads, D]`` in place (its first ``cos.shape[-1]``
    dims; ``cos`` / ``sin``: ``[N, rot_dim]``, x's dtype); returns ``x``."""
    return _module().rope_(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[N, 2 * inter]`` (gate columns first)."""
    return _module().silu_mul(gate_up)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[M, V]`` rows (rows contiguous): the first maximum, a
    ``nan`` counting as the largest value, as ``torch.argmax``; int64 ``[M]``."""
    return _module().row_argmax(logits)
