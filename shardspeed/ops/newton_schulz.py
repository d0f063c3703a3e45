"""Newton-Schulz orthogonalisation for Muon: ``G -> ~U V^T`` of ``G = U S V^T``.

The quintic iteration (Jordan et al., 2024) applies the odd polynomial
``p(s) = a s + b s^3 + c s^5`` (``a, b, c = 3.4445, -4.7750, 2.0315``) to every singular
value of ``X = G / ||G||_F`` (so ``s <= 1``), ``steps`` times, without an SVD::

    X: (short, long)                      # G transposed if it has more rows than columns
    repeat steps:  A = X X^T               # (short, short)
                   X = (a I + b A + c A^2) X

The coefficients maximise the slope at 0, so after 5 steps the singular values land in
roughly [0.7, 1.2] rather than exactly 1, which Muon does not mind.

``gram`` (DeepSpeed's default ``ns_method``) gives the same result in exact arithmetic
with fewer FLOPs for wide matrices: with ``P_k = a I + b R_k + c R_k^2`` and
``R_k = X_k X_k^T``, ``X_{k+1} = P_k X_k`` and ``R_{k+1} = P_k R_k P_k`` (``P_k`` is a
polynomial in ``R_k``, so they commute), so the iteration can run on the small square
``R`` and apply ``Q = P_{k-1} ... P_0`` to ``X`` once. Half precision drifts on long
products, so ``Q`` is applied and ``R`` rebuilt from ``X`` once, before step 2 (as DeepSpeed).

Both compute in ``dtype`` after normalising in fp32 (bf16/fp16 would overflow on large
gradients before the division).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
_RESTART_AT = 2  # gram: apply Q and rebuild R before this step


def _normalised_short_side(matrix: Tensor, dtype: torch.dtype) -> tuple[Tensor, bool]:
    """``matrix`` as (short, long), scaled to unit Frobenius norm, in ``dtype``."""
    x = matrix.float() if matrix.element_size() < 4 else matrix
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    return x.to(dtype), transposed


def newton_schulz(matrix: Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> Tensor:
    """The quintic iteration on a 2-D ``matrix``; returns ``dtype``, the shape of ``matrix``."""
    x, transposed = _normalised_short_side(matrix, dtype)  # (short, long)
    x = _iterate(x, steps)
    return x.T if transposed else x


def _iterate(x: Tensor, steps: int) -> Tensor:
    """``steps`` quintic steps on a normalised (short, long) ``x``."""
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T  # (short, short)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x


def gram_newton_schulz(
    matrix: Tensor, steps: int = 5, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The same iteration run on ``R = X X^T`` (see the module docstring)."""
    x, transposed = _normalised_short_side(matrix, dtype)  # (short, long)
    if x.size(0) == x.size(1):  # square: nothing to save
        x = _iterate(x, steps)
        return x.T if transposed else x
    a, b, c = NS_COEFFICIENTS
    eye = torch.eye(x.size(0), dtype=dtype, device=x.device)
    r = x @ x.T  # (short, short)
    q: Tensor | None = None  # product of the P_k since the last restart
    for k in range(steps):
        if k == _RESTART_AT and q is not None:
            x = q @ x
            r, q = x @ x.T, None
        p = a * eye + b * r + c * (r @ r)
        q = p if q is None else p @ q
        if k + 1 < steps and k + 1 != _RESTART_AT:
            r = p @ r @ p
    x = x if q is None else q @ x
    return x.T if transposed else x


def orthogonalise(
    update: Tensor, *, steps: int = 5, method: str = "gram", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Muon's orthogonalised update of one weight: Newton-Schulz on ``update`` viewed as
    ``(shape[0], -1)`` (conv filters), scaled by ``sqrt(max(1, rows / cols))`` so tall
    matrices get the RMS of square ones (as DeepSpeed), in ``update``'s dtype and shape."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method={method!r} is invalid; use one of {list(NS_METHODS)}.")
    matrix = update.reshape(update.size(0), -1)  # (rows, cols)
    rows, cols = matrix.shape
    run = gram_newton_schulz if method == "gram" else newton_schulz
    out = run(matrix, steps, dtype)
    if rows > cols:
        out = out * math.sqrt(rows / cols)
    return out.to(update.dtype).reshape(update.shape)
