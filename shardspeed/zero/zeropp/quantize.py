"""Symmetric block-wise quantization to int8 or int4, and its error bound.

A flat tensor is cut into rows (one per destination or per shard); each row is split into
``ceil(numel / max_block)`` equal blocks of at most ``max_block`` elements (even, for int4
packing; :func:`block_for`), the last padded with zeros, and every block gets one fp32
scale::

    row (numel,)  ->  padded (num_blocks * block,)  ->  blocks (num_blocks, block)
    scale[b] = max |x| over block b / qmax             qmax = 2**(bits-1) - 1 (127 or 7)
    q = round(x / scale) clamped to [-qmax, qmax]       int8 values (int4: two per byte)

Dequantizing gives ``q * scale``. Rounding to nearest makes the error of every element at
most half a step: ``|x - q * scale| <= scale / 2 = absmax(block) / (2 * qmax)``
(:func:`error_bound`), i.e. 1/254 of its block's largest magnitude for int8 and 1/14 for
int4. An all-zero block has scale 0 and is exact. int4 codes are stored offset by 8 in
``[1, 15]`` and packed two per ``uint8`` (even element in the low nibble), so an int4 row
costs ``block / 2`` bytes per block plus its 4-byte scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHT_BLOCK = 256  # qwZ: at most this many elements per scale (~1 + 4/256 bytes each)
GRAD_BLOCK = 256  # qgZ: at most this many elements per scale


def qmax(bits: int) -> int:
    """Largest code magnitude: 127 for int8, 7 for int4."""
    if bits not in (4, 8):
        raise ValueError(f"quantization bits={bits!r}: only 8 and 4 are supported.")
    return 2 ** (bits - 1) - 1


def block_for(numel: int, max_block: int) -> int:
    """Elements per block for a row of ``numel``: the fewest blocks of at most
    ``max_block``, made equal (so a short row is not padded to a whole ``max_block``),
    rounded up to even."""
    num_blocks = max(-(-numel // max_block), 1)
    block = -(-max(numel, 1) // num_blocks)
    return block + (block % 2)


def padded_len(numel: int, block: int) -> int:
    """``numel`` rounded up to whole blocks."""
    return -(-numel // block) * block


@dataclass
class Quantized:
    """Rows of block-quantized values: ``codes`` (rows, padded or padded/2 for int4) int8 /
    uint8, ``scales`` (rows, num_blocks) fp32; ``numel`` real elements per row."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * 4


@torch.no_grad()
def quantize_rows(x: torch.Tensor, bits: int, max_block: int) -> Quantized:
    """Quantize each row of ``x`` (rows, numel) in blocks of at most ``max_block``."""
    rows, numel = x.shape
    block = block_for(numel, max_block)
    padded = padded_len(numel, block)
    xf = torch.zeros(rows, padded, dtype=torch.float32, device=x.device)
    xf[:, :numel].copy_(x)
    blocks = xf.view(rows, padded // block, block)  # (rows, num_blocks, block)
    top = qmax(bits)
    scales = blocks.abs().amax(dim=-1) / top  # (rows, num_blocks)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-top, top)
    codes = codes.view(rows, padded).to(torch.int8)
    if bits == 4:
        codes = _pack_int4(codes)
    return Quantized(codes, scales, numel, bits, block)


@torch.no_grad()
def dequantize_rows(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(rows, numel) values ``codes * scale`` in ``dtype``."""
    codes = _unpack_int4(q.codes) if q.bits == 4 else q.codes
    rows, padded = codes.shape
    blocks = codes.view(rows, padded // q.block, q.block).to(torch.float32)
    values = (blocks * q.scales.unsqueeze(-1)).view(rows, padded)[:, : q.numel]
    return values if dtype == torch.float32 else values.to(dtype)


def error_bound(x: torch.Tensor, bits: int, max_block: int) -> torch.Tensor:
    """Per-element bound (rows, numel) of ``|x - dequantize(quantize(x))|``: half a step of
    each element's block, ``absmax(block) / (2 * qmax)``."""
    rows, numel = x.shape
    block = block_for(numel, max_block)
    padded = padded_len(numel, block)
    xf = torch.zeros(rows, padded, dtype=torch.float32, device=x.device)
    xf[:, :numel].copy_(x)
    absmax = xf.view(rows, padded // block, block).abs().amax(dim=-1)  # (rows, num_blocks)
    half_step = (absmax / (2 * qmax(bits))).repeat_interleave(block, dim=1)
    return half_step[:, :numel]


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    # codes: (rows, padded) int8 in [-7, 7] -> (rows, padded / 2) uint8, low nibble first
    shifted = (codes.to(torch.int16) + 8).to(torch.uint8)
    return shifted[:, 0::2] | (shifted[:, 1::2] << 4)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    # packed: (rows, padded / 2) uint8 -> (rows, padded) int8
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).view(packed.shape[0], -1)
