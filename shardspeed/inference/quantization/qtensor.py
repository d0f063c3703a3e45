"""Quantize a weight matrix and dequantize it back: the pure math, no kernels.

A linear weight ``W`` of shape ``(N, K)`` (out_features, in_features) is cut along ``K``
into groups of ``group_size`` columns (``group_size == K``: one group per output channel).
Every group ``g`` of row ``n`` has a scale ``s[n, g]`` and, when asymmetric, a zero point
``z[n, g]``; the stored integers ``q`` reconstruct the weight as::

    W[n, k] ~= (q[n, k] - z[n, k // group_size]) * s[n, k // group_size]

Integer ranges (``z`` is 0 / 8 for symmetric int8 / int4)::

    int8 symmetric   q in [-127, 127]  s = absmax / 127 (a weight already on a symmetric
                     grid keeps it: q in [-128, 127], see ``_symmetric_grid``)
    int8 asymmetric  q in [-128, 127]  s = (max - min) / 255, z = round(-128 - min / s)
    int4 symmetric   q in [0, 15]      s = absmax / 7 (q - 8 in [-8, 7])
    int4 asymmetric  q in [0, 15]      s = (max - min) / 15, z = round(-min / s)

int4 values are stored two per byte: ``packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EPS = 1e-12  # floor of a scale: an all-zero group must not divide by zero


@dataclass(frozen=True)
class QuantizedWeight:
    """The canonical (kernel-independent) form of one quantized weight matrix.

    Attributes:
        qdata: int8 ``(N, K)`` for 8 bits; uint8 ``(N, K // 2)`` nibble pairs for 4 bits.
        scales: float32 ``(N, K // group_size)``.
        zeros: float32 ``(N, K // group_size)`` integer-valued zero points, or None
            (symmetric: the implicit zero point is 0 for int8 and 8 for int4).
        bits: 8 or 4.
        group_size: columns per scale (``K`` for per-output-channel).
        shape: ``(N, K)`` of the original weight.
    """

    qdata: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    shape: tuple[int, int]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def zero_points(self) -> torch.Tensor:
        """``(N, G)`` float32 zero points, including the implicit symmetric ones."""
        if self.zeros is not None:
            return self.zeros
        implicit = 8.0 if self.bits == 4 else 0.0
        return torch.full_like(self.scales, implicit)

    def to(self, device: torch.device) -> QuantizedWeight:
        """This weight with its tensors on ``device``."""
        zeros = None if self.zeros is None else self.zeros.to(device)
        return QuantizedWeight(
            self.qdata.to(device), self.scales.to(device), zeros, self.bits, self.group_size,
            self.shape,
        )  # fmt: skip

    def int_values(self) -> torch.Tensor:
        """The stored integers as int32 ``(N, K)`` (int4 unpacked to 0..15)."""
        if self.bits == 8:
            return self.qdata.to(torch.int32)
        return unpack_int4(self.qdata)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` integers in [0, 15] -> ``(N, K // 2)`` uint8, even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)  # (N, K // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``(N, K // 2)`` uint8 -> ``(N, K)`` int32 in [0, 15]."""
    low = (packed & 0x0F).to(torch.int32)
    high = (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).flatten(-2)  # (N, K // 2, 2) -> (N, K)


def quantize_weight(
    weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool
) -> QuantizedWeight:
    """Quantize an ``(N, K)`` fp32/fp16/bf16 weight (math in fp32).

    ``group_size`` None means one group per output channel (``group_size = K``).
    """
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_weight expects a 2-D (out, in) weight, got {tuple(weight.shape)}"
        )
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r} is not supported; use 8 or 4.")
    n, k = weight.shape
    gs = k if group_size is None else group_size
    if k % gs != 0:
        raise ValueError(
            f"in_features={k} is not a multiple of group_size={gs}; pick a group size that "
            "divides the layer's input size or skip this layer."
        )
    if bits == 4 and k % 2 != 0:
        raise ValueError(f"int4 needs an even in_features (two values per byte), got {k}.")
    w = weight.detach().float().reshape(n, k // gs, gs)  # (N, G, gs)
    grid = _symmetric_grid(w, bits) if symmetric else None
    if grid is not None:  # already quantized (compression's redundancy_clean): kept exactly
        q, scales = grid
        if bits == 4:
            q = q + 8.0
        zeros = None
    elif symmetric:
        qmax = 127.0 if bits == 8 else 7.0
        scales = (w.abs().amax(-1) / qmax).clamp_min(_EPS)  # (N, G)
        q = torch.round(w / scales[..., None]).clamp(-qmax - (bits == 4), qmax)
        if bits == 4:
            q = q + 8.0  # stored unsigned: [-8, 7] -> [0, 15]
        zeros = None
    else:
        levels = 255.0 if bits == 8 else 15.0
        qmin = -128.0 if bits == 8 else 0.0
        lo = w.amin(-1).clamp_max(0.0)  # the range always includes 0: exact zeros stay exact
        hi = w.amax(-1).clamp_min(0.0)
        scales = ((hi - lo) / levels).clamp_min(_EPS)  # (N, G)
        zeros = torch.round(qmin - lo / scales).clamp(qmin, qmin + levels)  # (N, G)
        q = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp(qmin, qmin + levels)
    q = q.reshape(n, k)  # (N, K)
    qdata = q.to(torch.int8) if bits == 8 else pack_int4(q.to(torch.int32))
    return QuantizedWeight(qdata, scales.contiguous(), zeros, bits, gs, (n, k))


def _symmetric_grid(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q, scales)`` when ``w`` ``(N, G, gs)`` already lies on symmetric ``bits`` grids
    ``q * s``, q in ``[-2**(bits-1), 2**(bits-1) - 1]``, one step per group (what weight
    quantization in training leaves, e.g. ``shardspeed.compression.redundancy_clean``);
    else None.

    A group is on a grid when every value sits within 15% of a step of it (fp16 copies of
    grid values do: <= 2 * 2**-11 * 128 steps off; bf16 copies and trained weights do not).
    Steps tried: the group's absmax over ``2**(bits-1)`` when the lowest level is used
    (``-min > max``), else over ``2**(bits-1) - 1``. Where the extreme level is missing (a
    row that lost columns to pruning after its scale was fixed) the group's largest level is
    some ``j`` below it: once at least half of the groups are on their grids (the tensor is
    clearly a quantized one), the others try ``absmax / j`` for ``j`` down to half the
    levels. Groups found on no grid get the plain rule (absmax step, rounded), so the result
    is never coarser than plain rounding, and an unquantized weight returns None.
    """
    half = float(2 ** (bits - 1))
    n, g, gs = w.shape
    flat = w.reshape(n * g, gs)

    def on_grid(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.round(values / scales[:, None])
        near = (q * scales[:, None] - values).abs() <= 0.15 * scales[:, None]
        return q, near.all(-1) & (q.amin(-1) >= -half) & (q.amax(-1) <= half - 1)

    absmax = flat.abs().amax(-1)  # (NG,)
    negative_extreme = -flat.amin(-1) > flat.amax(-1)  # level -2**(bits-1) is used
    scales = (absmax / torch.where(negative_extreme, half, half - 1)).clamp_min(_EPS)
    q, ok = on_grid(flat, scales)
    if bool(ok.all()):
        return q.reshape(n, g, gs), scales.reshape(n, g)
    rest = (~ok).nonzero().squeeze(-1)

    def try_level(rest: torch.Tensor, level: int) -> torch.Tensor:
        """Groups of ``rest`` on the grid whose largest level is ``level``: taken; the others
        are returned."""
        step = (absmax[rest] / level).clamp_min(_EPS)
        q_rest, ok_rest = on_grid(flat[rest], step)
        found = rest[ok_rest]
        q[found], scales[found] = q_rest[ok_rest], step[ok_rest]
        return rest[~ok_rest]

    rest = try_level(rest, int(half) - 1)  # a -2**(bits-1)+1 extreme read as -2**(bits-1)
    if 2 * rest.numel() > ok.numel():
        return None  # not a quantized tensor (or too few groups on a grid to tell)
    for level in range(int(half) - 2, int(half) // 2 - 1, -1):
        if rest.numel() == 0:
            break
        rest = try_level(rest, level)
    if rest.numel():  # on no grid: absmax / qmax and rounding, as without a grid
        scales[rest] = (absmax[rest] / (half - 1)).clamp_min(_EPS)
        q[rest] = torch.round(flat[rest] / scales[rest, None]).clamp(-half, half - 1)
    return q.reshape(n, g, gs), scales.reshape(n, g)


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``(N, K)`` weight the quantized form represents, in ``dtype`` (math in fp32)."""
    n, k = qw.shape
    q = qw.int_values().float().reshape(n, k // qw.group_size, qw.group_size)  # (N, G, gs)
    w = (q - qw.zero_points()[..., None]) * qw.scales[..., None]  # (N, G, gs)
    return w.reshape(n, k).to(dtype)  # (N, K)


def slice_quantized(
    qw: QuantizedWeight, pieces: list[range], dim: int, name: str = "weight"
) -> QuantizedWeight:
    """The quantized form of ``W``'s index ranges ``pieces`` along ``dim``, cut from ``qw``.

    The integers, scales and zero points are those ``qw`` holds, so dequantizing the
    slice equals slicing the dequantized ``W`` exactly (tensor-parallel ranks hold
    such slices of the weight quantized once, whole). ``dim=0`` keeps whole rows;
    ``dim=1`` keeps columns and every cut must fall on a group boundary, except for
    a per-output-channel weight (one group per row), whose slice keeps the row's
    scale over the columns it holds. ``ValueError`` (naming ``name``) otherwise.
    """
    n, k = qw.shape
    if dim == 0:
        keep = torch.cat([torch.arange(r.start, r.stop) for r in pieces])  # (N_local,)
        zeros = None if qw.zeros is None else qw.zeros[keep]
        return QuantizedWeight(
            qw.qdata[keep], qw.scales[keep], zeros, qw.bits, qw.group_size, (len(keep), k)
        )
    per_channel = qw.group_size == k
    cuts = [c for r in pieces for c in (r.start, r.stop)]
    if not per_channel and any(c % qw.group_size for c in cuts):
        raise ValueError(
            f"cannot cut columns {[(r.start, r.stop) for r in pieces]} of {name} {qw.shape} "
            f"quantized with group_size={qw.group_size}: every cut must be a multiple of the "
            "group size; pick a group_size that divides each rank's share of the input columns, "
            "another tensor_parallel degree, or skip this layer (skip_modules)."
        )
    if qw.bits == 4 and any(c % 2 for c in cuts):
        raise ValueError(f"int4 columns of {name} must be cut at even indices, got {cuts}.")
    width = sum(len(r) for r in pieces)

    def cols(t: torch.Tensor, per: int) -> torch.Tensor:  # (N, k / per) -> (N, width / per)
        return torch.cat([t[:, r.start // per : r.stop // per] for r in pieces], dim=1)

    qdata = cols(qw.qdata, 1 if qw.bits == 8 else 2)
    if per_channel:
        return QuantizedWeight(qdata, qw.scales, qw.zeros, qw.bits, width, (n, width))
    zeros = None if qw.zeros is None else cols(qw.zeros, qw.group_size)
    scales = cols(qw.scales, qw.group_size)
    return QuantizedWeight(qdata, scales, zeros, qw.bits, qw.group_size, (n, width))
