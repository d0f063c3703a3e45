"""Numeric parity assertions whose failure message points at the worst element."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64)
    if isinstance(value, (int, float)):
        return torch.tensor([float(value)], dtype=torch.float64)
    if isinstance(value, Sequence):
        try:
            return torch.as_tensor([float(v) for v in value], dtype=torch.float64)
        except (TypeError, ValueError):
            pass
        return torch.as_tensor(value, dtype=torch.float64)
    raise TypeError(
        f"assert_close_rel: {name} must be a tensor, a number or a list of numbers, "
        f"got {type(value).__name__}"
    )


def assert_close_rel(
    actual: Any,
    expected: Any,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    msg: str = "",
    equal_nan: bool = False,
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` element-wise.

    ``actual``/``expected`` are tensors (any dtype/device; compared in float64 on CPU),
    numbers or (nested) lists of numbers, with equal shapes. On failure the
    ``AssertionError`` names how many elements mismatch and the worst one (index, both
    values, absolute and relative error), prefixed by ``msg``.
    """
    a = _as_tensor(actual, "actual")
    e = _as_tensor(expected, "expected")
    prefix = f"{msg}: " if msg else ""
    if a.shape != e.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(a.shape)} vs expected {tuple(e.shape)}"
        )
    if a.numel() == 0:
        return
    diff = (a - e).abs()
    allowed = atol + rtol * e.abs()
    bad = diff > allowed
    nan_a, nan_e = a.isnan(), e.isnan()
    both_nan = nan_a & nan_e
    bad |= (nan_a | nan_e) & ~(both_nan if equal_nan else torch.zeros_like(both_nan))
    bad |= (a.isinf() | e.isinf()) & (a != e)
    if not bool(bad.any()):
        return
    # Rank mismatches by how far past their allowance they are (NaN/inf first).
    excess = torch.where(bad, diff - allowed, torch.full_like(diff, -1.0))
    excess = torch.where(bad & excess.isnan(), torch.full_like(excess, float("inf")), excess)
    flat_idx = int(excess.flatten().argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_idx), a.shape))
    av, ev = float(a.flatten()[flat_idx]), float(e.flatten()[flat_idx])
    abs_err = abs(av - ev)
    rel_err = abs_err / abs(ev) if ev != 0 else float("inf")
    num_bad = int(bad.sum())
    raise AssertionError(
        f"{prefix}{num_bad} of {a.numel()} elements differ beyond rtol={rtol:g}, atol={atol:g}; "
        f"worst at index {idx}: actual={av!r} expected={ev!r} abs_err={abs_err:.3e} "
        f"rel_err={rel_err:.3e}; max abs_err over all={float(diff.nan_to_num(float('inf')).max()):.3e}"
    )
