"""Fused causal self-attention for Llama-family layers: fused QKV, fused rotary, SDPA.

A drop-in for Hugging Face's ``LlamaAttention`` / ``MistralAttention`` / ``Qwen2Attention``
(same ``forward`` arguments and ``(output, None)`` return), so the decoder layer, the model's
mask building and ``generate``'s KV cache are Hugging Face's own::

    q, k, v = qkv(x)                     one matmul             (B, T, (Hq + 2 Hkv) D)
    q, k = rotary(q, k, cos, sin)        one elementwise pass   (B, H, T, D)
    k, v = cache.update(k, v, layer)     HF's KV cache          (B, Hkv, S, D)
    o = SDPA(q, k, v, mask, enable_gqa)  no repeat of k/v       (B, Hq, T, D)
    y = o_proj(o)                        row-parallel: one all-reduce

Head counts are this rank's (a tensor-parallel rank holds whole KV-head groups). Masks:
Hugging Face's boolean (``sdpa``) or additive float (``eager``) masks are used as given; with
no mask, the causal (and sliding-window) mask is built bottom-right aligned, so it is also
right when new tokens attend to cached ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.inference.injection.fused_qkv import FusedQKV
from shardspeed.inference.injection.rotary import apply_rotary


def causal_mask(
    q_len: int, kv_len: int, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """Boolean (q_len, kv_len) mask, True = attend; queries are the last ``q_len`` positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)  # (q, 1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)  # (1, kv)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal grouped-query attention through ``scaled_dot_product_attention``.

    ``q``: (B, Hq, T, D); ``k``, ``v``: (B, Hkv, S, D) with Hq a multiple of Hkv; ``mask``:
    HF's 4-D bool / additive mask (B or 1, 1, T, S) or None (causal). Returns (B, Hq, T, D).
    """
    q_len, kv_len = q.shape[2], k.shape[2]
    if mask is None and q_len > 1:
        window = sliding_window if sliding_window and kv_len > sliding_window else None
        if q_len == kv_len and window is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
            )
        mask = causal_mask(q_len, kv_len, q.device, window)  # (T, S)
    elif mask is not None:
        mask = mask[..., :kv_len]  # static caches hand masks as long as the cache
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )


class FusedAttention(nn.Module):
    """Fused replacement of a Llama-family attention module (see the module docstring)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.is_causal = True
        self.sliding_window = getattr(attention, "sliding_window", None)
        if self.sliding_window is None and type(attention).__name__.startswith("Mistral"):
            self.sliding_window = getattr(attention.config, "sliding_window", None)
        self.qkv = FusedQKV(attention.q_proj, attention.k_proj, attention.v_proj)
        self.o_proj = attention.o_proj
        self.num_heads = self.qkv.q_width // self.head_dim  # this rank's
        self.num_key_value_heads = self.qkv.k_width // self.head_dim
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        batch, seq = hidden_states.shape[:2]
        q, k, v = self.qkv(hidden_states)  # (B, T, H * D) each
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, Hkv, S, D)
        out = sdpa_attention(q, k, v, attention_mask, self.scaling, self.sliding_window)
        out = out.transpose(1, 2).reshape(batch, seq, -1)  # (B, T, Hq * D)
        return self.o_proj(out), None

    def extra_repr(self) -> str:
        return (
            f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_key_value_heads}, "
            f"head_dim={self.head_dim}"
        )
