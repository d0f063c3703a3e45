"""``DistributedAttention``: DeepSpeed-Ulysses sequence parallelism around any local attention.

Each rank of the sequence group holds ``s/p`` tokens of q, k and v. One all-to-all per
tensor gives every rank the full sequence for ``h/p`` heads; the local attention runs on
that; one all-to-all turns its output back into ``s/p`` tokens of every head::

    q, k, v   (s/p, b, h, d)   this rank's tokens, every head         [b, s/p, h, d] if batch_dim_idx=0
       | seq_to_heads (scatter heads, gather sequence)
    q, k, v   (s, b, h/p, d)   every token, this rank's heads
       | local_attention(q, k, v, *args, **kwargs)
    context   (s, b, h/p, d)
       | heads_to_seq (scatter sequence, gather heads)
    output    (s/p, b, h, d)

Backward runs the adjoint all-to-alls in reverse. Heads are dealt out by KV group
(:mod:`~.heads`): grouped-query attention keeps each query head with its KV head, KV heads
fewer than ranks are replicated, uneven counts split unevenly, impossible ones raise.

The calling convention is DeepSpeed 0.19.8's ``deepspeed.sequence.layer.DistributedAttention``:
``forward(query, key, value, batch_dim_idx, rotary_pos_emb=None, *args, **kwargs)``, where
``batch_dim_idx`` (0 or 1) decides the layout and the sequence dim is the other one (as in
DeepSpeed, ``gather_idx`` only supplies the default when ``batch_dim_idx`` is omitted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardspeed import comm
from shardspeed.parallel.sequence.all_to_all import heads_to_seq, replicate_kv_heads, seq_to_heads
from shardspeed.parallel.sequence.heads import plan_heads
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

_HEAD_DIM = 2  # q, k, v are (s, b, h, d) or (b, s, h, d): heads are always dim 2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``cos.shape[-1]`` features of ``t`` (the rest pass through)."""
    rot_dim = cos.shape[-1]
    rotated, rest = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


class DistributedAttention(nn.Module):
    """Ulysses attention: ``local_attention`` on the full sequence for this rank's heads.

    Args:
        local_attention: callable ``(q, k, v, *args, **kwargs) -> context`` on full-sequence
            tensors in the same layout as the inputs, with this rank's heads; ``context``
            has the query's head count.
        sequence_process_group: the sequence-axis group (e.g.
            ``topology.group("sequence")`` or :func:`~.groups.sequence_group`).
        scatter_idx: the head dim of the inputs; must be 2.
        gather_idx: the sequence dim (0 for ``[s/p, b, h, d]``, 1 for ``[b, s/p, h, d]``);
            only the default for ``batch_dim_idx``.
        sp_stream: accepted for DeepSpeed compatibility; the all-to-alls run on the current
            stream (no q/k/v communication overlap).
        num_kv_heads: optional check of the key/value head count (it is read from ``key``).
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        if scatter_idx != _HEAD_DIM:
            raise ValueError(
                f"DistributedAttention(scatter_idx={scatter_idx!r}): the first all-to-all "
                f"scatters the head dim, which is dim {_HEAD_DIM} of [s, b, h, d] and "
                f"[b, s, h, d] inputs; pass scatter_idx={_HEAD_DIM}."
            )
        if gather_idx not in (0, 1):
            raise ValueError(
                f"DistributedAttention(gather_idx={gather_idx!r}) must be the sequence dim: 0 "
                "for [s/p, b, h, d] inputs, 1 for [b, s/p, h, d]."
            )
        if sequence_process_group is None:
            raise ValueError(
                "DistributedAttention needs sequence_process_group (None would mean the whole "
                "world); pass topology.group('sequence') or "
                "shardspeed.parallel.sequence.sequence_group(sp_size)."
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        if sp_stream is not None:
            logger.info("DistributedAttention: sp_stream is ignored; all-to-alls run in order")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int | None = None,
        rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention over the whole sequence; returns this rank's tokens, every head."""
        if batch_dim_idx is None:
            batch_dim_idx = 1 - self.gather_idx
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 or 1, got {batch_dim_idx!r}")
        seq_dim = 1 - batch_dim_idx
        self._check_inputs(query, key, value)
        num_ranks = comm.get_world_size(self.spg)
        layout = plan_heads(query.shape[_HEAD_DIM], key.shape[_HEAD_DIM], num_ranks)

        key = replicate_kv_heads(key, layout.kv_replicas)  # (.., .., h_kv * replicas, d)
        value = replicate_kv_heads(value, layout.kv_replicas)
        # (s/p, b, h, d) -> (s, b, h_r, d)   [or (b, s/p, h, d) -> (b, s, h_r, d)]
        query = seq_to_heads(query, layout.q_counts, self.spg, seq_dim)
        key = seq_to_heads(key, layout.kv_counts, self.spg, seq_dim)
        value = seq_to_heads(value, layout.kv_counts, self.spg, seq_dim)
        if rotary_pos_emb is not None:
            # DeepSpeed's convention: (cos, sin), each (b, s, 1, rot_dim) -> (s, b, 1, rot_dim)
            cos, sin = (t.permute(1, 0, 2, 3) for t in rotary_pos_emb)
            query = apply_rotary_pos_emb(query, cos, sin)
            key = apply_rotary_pos_emb(key, cos, sin)

        context = self.local_attn(query, key, value, *args, **kwargs)  # (s, b, h_r, d)
        return heads_to_seq(context, layout.q_counts, self.spg, seq_dim)  # (s/p, b, h, d)

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.shape != value.shape:
            raise ValueError(
                f"DistributedAttention: key {tuple(key.shape)} and value {tuple(value.shape)} "
                "must have the same shape."
            )
        if query.dim() != 4 or key.dim() != 4 or query.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"DistributedAttention: query {tuple(query.shape)} and key {tuple(key.shape)} "
                "must be 4-D with the same (sequence, batch) dims: [s/p, b, h, d] or [b, s/p, h, d]."
            )
        if self.num_kv_heads is not None and self.num_kv_heads != key.shape[_HEAD_DIM]:
            raise ValueError(
                f"DistributedAttention(num_kv_heads={self.num_kv_heads}) but key has "
                f"{key.shape[_HEAD_DIM]} heads (shape {tuple(key.shape)}); pass the key's head "
                "count or leave num_kv_heads unset."
            )
