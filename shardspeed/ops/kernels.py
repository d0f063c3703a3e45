"""Which torch kernel (fused / foreach / single-tensor) an optimizer should use.

Measured with ``benchmarks/cpu_adam_bench.py`` (10M-element flat fp32 tensor, torch 2.13,
2 threads; see ``docs/optimizers.md``): on CPU the fused kernels of Adam/AdamW/Adagrad/SGD
are 6-10x faster than foreach and single-tensor, so fused is the default on CPU as well as
on CUDA whenever every parameter is a floating-point tensor on one supported device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

# class -> device types whose fused kernel exists and measured fastest
_FUSED_DEVICES: dict[type[torch.optim.Optimizer], frozenset[str]] = {
    torch.optim.Adam: frozenset({"cuda", "cpu"}),
    torch.optim.AdamW: frozenset({"cuda", "cpu"}),
    torch.optim.SGD: frozenset({"cuda", "cpu"}),
    torch.optim.Adagrad: frozenset({"cpu"}),
}


def materialize(param_groups: Any) -> list[Any]:
    """Turn generators (``model.parameters()``, group dicts holding one) into lists."""
    if isinstance(param_groups, Tensor):
        return [param_groups]
    groups = []
    for item in param_groups:
        if isinstance(item, Mapping) and not isinstance(item.get("params"), (list, Tensor)):
            item = {**item, "params": list(item.get("params", []))}
        groups.append(item)
    return groups


def param_tensors(param_groups: Iterable[Any]) -> list[Tensor]:
    """The tensors of a list of tensors, ``(name, tensor)`` pairs or ``{"params": ...}`` dicts."""
    tensors: list[Tensor] = []
    for item in param_groups:
        if isinstance(item, Mapping):
            group_params = item.get("params", [])
            items = [group_params] if isinstance(group_params, Tensor) else list(group_params)
        else:
            items = [item]
        for entry in items:
            if isinstance(entry, tuple) and len(entry) == 2:
                entry = entry[1]  # (name, tensor)
            if isinstance(entry, Tensor):
                tensors.append(entry)
    return tensors


def _fused_base(optimizer_cls: type) -> type[torch.optim.Optimizer] | None:
    for base in optimizer_cls.__mro__:
        if base in _FUSED_DEVICES:
            return base
    return None


def default_kernel_flags(
    optimizer_cls: type, tensors: list[Tensor], requested: Mapping[str, Any] | None = None
) -> dict[str, bool]:
    """Keyword flags (``fused=True`` or nothing) for the fastest kernel of ``optimizer_cls``.

    Returns ``{}`` when the caller already chose (``fused``/``foreach`` in ``requested``),
    when the class has no fused kernel, or when the tensors are not all floating point on
    one device type that the fused kernel supports (torch then picks its own default).
    """
    requested = requested or {}
    if requested.get("fused") is not None or requested.get("foreach") is not None:
        return {}
    if requested.get("differentiable"):
        return {}
    base = _fused_base(optimizer_cls)
    if base is None or not tensors:
        return {}
    device_types = {t.device.type for t in tensors}
    if len(device_types) != 1 or not device_types <= _FUSED_DEVICES[base]:
        return {}
    if not all(torch.is_floating_point(t) for t in tensors):
        return {}
    return {"fused": True}
