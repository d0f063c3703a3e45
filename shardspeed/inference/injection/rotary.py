"""Fused rotary position embedding: queries and keys rotated in one elementwise pass.

The rotation of Hugging Face's ``apply_rotary_pos_emb`` (the "rotate half" convention):
``x * cos + rotate_half(x) * sin``, applied once to ``[q | k]`` stacked on the head axis
instead of twice, so the cos/sin broadcast and the rotate are computed once::

    q: (B, Hq, T, D)   k: (B, Hkv, T, D)   cos, sin: (B, T, D)
    qk = cat(q, k, dim=1)                  (B, Hq + Hkv, T, D)
    qk = qk * cos + rotate_half(qk) * sin
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` (B, Hq, T, D) and ``k`` (B, Hkv, T, D) by ``cos``/``sin`` (B, T, D)."""
    num_q_heads = q.shape[1]
    qk = torch.cat((q, k), dim=1)  # (B, Hq + Hkv, T, D)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
    rotary_dim = cos.shape[-1]
    if rotary_dim == qk.shape[-1]:
        qk = qk * cos + rotate_half(qk) * sin
    else:  # partial rotary: only the first rotary_dim features rotate
        rot, rest = qk[..., :rotary_dim], qk[..., rotary_dim:]
        qk = torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
    return qk[:, :num_q_heads], qk[:, num_q_heads:]
