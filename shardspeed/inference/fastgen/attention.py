"""Attention of ragged query tokens over each sequence's blocked KV cache.

For a sequence with ``start`` cached tokens and ``n`` new ones, query ``i`` (at
position ``start + i``) attends to key positions ``0 .. start + i``; the key of
position ``p`` lives in slot ``block_table[p // block_size] * block_size + p %
block_size``. New K/V are written to their slots *before* attending, so a chunk
attends to itself causally. Decodes (``n == 1``) and prompt chunks are the same
formula.

Per-layer options: ``window`` (sliding-window attention: query at position
``q`` sees keys ``q - window < p <= q``, HF's convention), ``scale`` (default
``head_dim ** -0.5``) and ``softcap`` (Gemma 2: ``tanh(s / cap) * cap`` on the
scores before masking; computed without SDPA in the torch backend).

Backends (chosen once per engine, see :func:`select_backend`):

* ``"torch"`` (CPU and fallback on CUDA): decodes of similar context length
  are batched into one padded SDPA call with a length mask (groups keep padding
  small; see :func:`~shardspeed.inference.fastgen.ragged.group_decodes`); each
  prompt chunk runs its own SDPA with a causal offset mask (or ``is_causal``
  when it starts at position 0).
* ``"cpu"`` (CPU, the default where it builds): every decode of the step in one call of
  the native kernel (:mod:`~shardspeed.inference.fastgen.cpu_attention`), which reads the
  blocks in place through each sequence's block table and accumulates in fp32; prompt
  chunks as in ``"torch"``.
* ``"flash"`` (CUDA, ``flash_attn`` importable, ``block_size % 256 == 0``):
  ``flash_attn_varlen_func`` reads the paged cache through ``block_table``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardspeed.inference.fastgen.kv_cache import KVCache
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash")


@dataclass
class ChunkMeta:
    """One sequence computed with more than one query token (a prompt chunk)."""

    token_start: int  # first row of the sequence in the ragged batch
    num_tokens: int
    context_len: int
    blocks: torch.Tensor  # [num_blocks_of_seq] its block table
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None => is_causal


@dataclass
class DecodeGroup:
    """Single-token sequences of similar context length, attended in one padded SDPA call."""

    rows: torch.Tensor  # [G] rows of the ragged batch
    block_table: torch.Tensor  # [G, MB] (padding -> block 0)
    mask: torch.Tensor | None  # [G, 1, 1, MB * block_size] bool, None when nothing is padded


@dataclass
class DecodeBatch:
    """The ``"cpu"`` backend's one kernel call: every single-token sequence of the step, and
    each token of a short chunk as its own row (see ``ragged._torch_metadata``)."""

    rows: torch.Tensor  # [S] rows of the ragged batch
    block_table: torch.Tensor  # [S, MB] int64 (unused entries are never read)
    context_lens: torch.Tensor  # [S] int64
    all_rows: bool  # rows == arange(N): no chunk needs SDPA this step


@dataclass
class AttentionMetadata:
    """Per-step attention bookkeeping shared by every layer."""

    backend: str
    # torch backend
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    chunks: list[ChunkMeta] = field(default_factory=list)
    # cpu backend (chunks as above)
    decodes: DecodeBatch | None = None
    # flash backend
    cu_seqlens_q: torch.Tensor | None = None  # [S + 1] int32
    cu_seqlens_k: torch.Tensor | None = None  # [S + 1] int32
    block_table: torch.Tensor | None = None  # [S, max_blocks] int32
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # sliding-window masks, built once per step per window size and reused by every layer
    window_masks: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)


def flash_attn_available() -> bool:
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except Exception:
        return False
    return True


def select_backend(
    requested: str, device: torch.device, block_size: int, dtype: torch.dtype = torch.float16
) -> str:
    """Resolve ``"auto"`` to ``"flash"`` (CUDA), ``"cpu"`` (CPU, where the native kernel
    builds) or ``"torch"``; validate explicit choices."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"EngineConfig.attention_backend={requested!r} is not supported; "
            f"choose one of {ATTENTION_BACKENDS}."
        )
    flash_ok = (
        device.type == "cuda"
        and block_size % 256 == 0
        and dtype in (torch.float16, torch.bfloat16)
        and flash_attn_available()
    )
    if requested == "flash" and not flash_ok:
        raise ValueError(
            "attention_backend='flash' needs a CUDA device, flash_attn installed, fp16/bf16 "
            f"weights and block_size divisible by 256 (got block_size={block_size}, "
            f"device={device}, dtype={dtype}); use attention_backend='auto'."
        )
    if requested == "cpu" and device.type != "cpu":
        raise ValueError(
            f"attention_backend='cpu' runs on CPU tensors only (device={device}); use "
            "attention_backend='auto'."
        )
    if requested == "cpu" or (requested == "auto" and device.type == "cpu"):
        from shardspeed.inference.fastgen.cpu_attention import kernel_available

        if kernel_available():
            backend = "cpu"
        elif requested == "cpu":
            raise ValueError(
                "attention_backend='cpu' needs FastGen's native CPU attention kernel, which "
                "could not be built here (see the warning above); use attention_backend='auto' "
                "or 'torch'."
            )
        else:
            backend = "torch"
    else:
        backend = "flash" if flash_ok and requested in ("auto", "flash") else "torch"
    logger.info("attention backend: %s (device=%s, block_size=%d)", backend, device, block_size)
    return backend


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    layer: int,
    slot_mapping: torch.Tensor,
    meta: AttentionMetadata,
    *,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write ``k``/``v`` of the new tokens, then attend; returns ``[N, H, D]``.

    ``q``: ``[N, H, D]``; ``k``, ``v``: ``[N, H_kv, D]`` for the N ragged tokens.
    ``window``: sliding-window size in tokens (None: full causal attention);
    ``scale``: score scale (None: ``D ** -0.5``); ``softcap``: score soft-capping.
    """
    kv_cache.write(layer, slot_mapping, k, v)
    if meta.backend == "flash":
        return _flash_attention(q, kv_cache, layer, meta, window, scale, softcap)
    return _torch_attention(q, kv_cache, layer, meta, window, scale, softcap)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA over ``[B, H, Lq, D]`` queries and ``[B, H_kv, Lk, D]`` keys (GQA by broadcast).

    With ``softcap`` the scores are computed explicitly (SDPA cannot cap them),
    softmax in fp32 like HF's eager attention.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # [B, H, Lk, D]
    v = v.repeat_interleave(groups, dim=1)  # [B, H, Lk, D]
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap  # [B, H, Lq, Lk]
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v  # [B, H, Lq, D]


def _decode_window_mask(
    g: DecodeGroup, padded_len: int, window: int, device: torch.device
) -> torch.Tensor:
    """``[G, 1, 1, padded_len]``: the last ``window`` keys of each padded decode row."""
    if g.mask is None:
        lens = torch.full((g.rows.numel(),), padded_len, device=device)
    else:
        lens = g.mask[:, 0, 0, :].sum(-1)  # [G] context lengths
    keys = torch.arange(padded_len, device=device).unsqueeze(0)  # [1, L]
    keep = (keys < lens.unsqueeze(1)) & (keys >= lens.unsqueeze(1) - window)  # [G, L]
    return keep[:, None, None, :]


def _chunk_window_mask(c: ChunkMeta, window: int, device: torch.device) -> torch.Tensor:
    """``[n, context_len]``: causal and within ``window`` of each query of a prompt chunk."""
    q_pos = torch.arange(c.context_len - c.num_tokens, c.context_len, device=device).unsqueeze(1)
    keys = torch.arange(c.context_len, device=device).unsqueeze(0)  # [1, ctx]
    return (keys <= q_pos) & (keys > q_pos - window)  # [n, ctx]


def _torch_attention(
    q: torch.Tensor,
    kv_cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]  # [num_blocks, BS, H_kv, D]
    n_tok, n_heads, d = q.shape
    n_kv = k_cache.shape[2]
    dec = meta.decodes
    if dec is not None and dec.all_rows and not meta.chunks:
        return _native_decode(q, k_cache, v_cache, dec, window, scale, softcap)
    out = torch.empty_like(q)  # [N, H, D]
    if dec is not None:
        out[dec.rows] = _native_decode(q[dec.rows], k_cache, v_cache, dec, window, scale, softcap)
    for gi, g in enumerate(meta.decode_groups):
        num = g.rows.numel()
        # Gather whole blocks (contiguous copies), not single slots.
        kd = k_cache[g.block_table].view(num, -1, n_kv, d).transpose(1, 2)  # [G, H_kv, L, D]
        vd = v_cache[g.block_table].view(num, -1, n_kv, d).transpose(1, 2)  # [G, H_kv, L, D]
        # One query token: the query heads sharing a KV head act as that head's queries.
        qd = q[g.rows].view(num, n_kv, n_heads // n_kv, d)  # [G, H_kv, H / H_kv, D]
        mask = g.mask
        if window is not None and window < kd.shape[2]:
            key = ("decode", gi, window)
            if key not in meta.window_masks:
                meta.window_masks[key] = _decode_window_mask(g, kd.shape[2], window, q.device)
            mask = meta.window_masks[key]
        od = _sdpa(qd, kd.to(q.dtype), vd.to(q.dtype), mask, False, scale, softcap)
        out[g.rows] = od.reshape(num, n_heads, d)
    for ci, c in enumerate(meta.chunks):
        kc = k_cache[c.blocks].view(-1, n_kv, d)[: c.context_len].transpose(0, 1)  # [H_kv, L, D]
        vc = v_cache[c.blocks].view(-1, n_kv, d)[: c.context_len].transpose(0, 1)  # [H_kv, L, D]
        qc = q[c.token_start : c.token_start + c.num_tokens].transpose(0, 1)  # [H, n, D]
        mask = c.mask
        if window is not None and window < c.context_len:
            key = ("chunk", ci, window)
            if key not in meta.window_masks:
                meta.window_masks[key] = _chunk_window_mask(c, window, q.device)
            mask = meta.window_masks[key]
        oc = _sdpa(
            qc.unsqueeze(0),
            kc.unsqueeze(0).to(q.dtype),
            vc.unsqueeze(0).to(q.dtype),
            mask,
            mask is None,
            scale,
            softcap,
        )  # [1, H, n, D]
        out[c.token_start : c.token_start + c.num_tokens] = oc[0].transpose(0, 1)
    return out


def _native_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dec: DecodeBatch,
    window: int | None,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """``[S, H, D]``: the ``"cpu"`` backend's decodes, one native kernel call."""
    from shardspeed.inference.fastgen.cpu_attention import paged_decode

    return paged_decode(
        q, k_cache, v_cache, dec.block_table, dec.context_lens,
        scale=scale if scale is not None else q.shape[-1] ** -0.5, window=window, softcap=softcap,
    )  # fmt: skip


def _flash_attention(
    q: torch.Tensor,
    kv_cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # pragma: no cover - needs CUDA + flash_attn
    from flash_attn import flash_attn_varlen_func

    extra = {}
    if window is not None:
        extra["window_size"] = (window - 1, 0)  # keys q - window + 1 .. q
    if softcap is not None:
        extra["softcap"] = softcap
    return flash_attn_varlen_func(
        q,
        kv_cache.k[layer],
        kv_cache.v[layer],
        meta.cu_seqlens_q,
        meta.cu_seqlens_k,
        meta.max_seqlen_q,
        meta.max_seqlen_k,
        softmax_scale=scale,
        causal=True,  # bottom-right aligned: query i sees keys <= start + i
        block_table=meta.block_table,
        **extra,
    )
