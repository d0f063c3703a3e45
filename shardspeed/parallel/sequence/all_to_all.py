"""The Ulysses all-to-alls: move the split from the sequence dim to the head dim and back.

Activations are 4-D, ``(s, b, h, d)`` (sequence first, ``seq_dim=0``) or ``(b, s, h, d)``
(``seq_dim=1``). With ``p`` ranks, rank ``r`` holding tokens ``[r*s/p, (r+1)*s/p)`` and
``counts[r]`` heads (a :class:`~.heads.HeadLayout` count tuple)::

    seq_to_heads:  (s/p, b, H, d)  --all-to-all-->  (s, b, counts[r], d)
                   scatter heads, gather sequence   (before local attention)
    heads_to_seq:  (s, b, counts[r], d)  --all-to-all-->  (s/p, b, H, d)
                   scatter sequence, gather heads   (after local attention)

Both are a permute into "rows" (dim 0 = what is exchanged), one ``all_to_all_single`` and a
permute back; the exchange is :func:`all_to_all_rows`, whose backward is the same exchange
with send and receive sizes swapped, so the backward of ``seq_to_heads`` is
``heads_to_seq`` on the gradients and vice versa. Uneven head counts use split sizes.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm


class _AllToAllRows(torch.autograd.Function):
    """Send ``send_rows[j]`` rows of dim 0 to rank ``j``; receive ``recv_rows[i]`` from rank ``i``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: Any,
        send_rows: tuple[int, ...],
        recv_rows: tuple[int, ...],
    ) -> torch.Tensor:
        ctx.group, ctx.send_rows, ctx.recv_rows = group, send_rows, recv_rows
        return _exchange(x, group, send_rows, recv_rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.group, ctx.recv_rows, ctx.send_rows), None, None, None


def _exchange(
    x: torch.Tensor, group: Any, send_rows: tuple[int, ...], recv_rows: tuple[int, ...]
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    even = len(set(send_rows)) == 1 and len(set(recv_rows)) == 1
    comm.all_to_all_single(
        out,
        x,
        output_split_sizes=None if even else list(recv_rows),
        input_split_sizes=None if even else list(send_rows),
        group=group,
    )
    return out


def all_to_all_rows(
    x: torch.Tensor, group: Any, send_rows: tuple[int, ...], recv_rows: tuple[int, ...]
) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 (``x.shape[0] == sum(send_rows)``)."""
    if x.shape[0] != sum(send_rows):
        raise AssertionError(f"all_to_all_rows: {x.shape[0]} rows but send_rows={send_rows}")
    return _AllToAllRows.apply(x, group, tuple(send_rows), tuple(recv_rows))


def _check_layout(x: torch.Tensor, seq_dim: int, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(
            f"Ulysses attention expects 4-D {what} activations (s, b, h, d) or (b, s, h, d), "
            f"got shape {tuple(x.shape)}; reshape the hidden dim into (heads, head_dim) first."
        )
    if seq_dim not in (0, 1):
        raise ValueError(f"seq_dim must be 0 or 1 (the batch dim is the other), got {seq_dim!r}")


def seq_to_heads(
    x: torch.Tensor, counts: tuple[int, ...], group: Any, seq_dim: int = 0
) -> torch.Tensor:
    """This rank's ``s/p`` tokens of every head -> every token of its ``counts[rank]`` heads."""
    _check_layout(x, seq_dim, "input")
    num_ranks, rank = len(counts), comm.get_rank(group)
    if x.shape[2] != sum(counts):
        raise AssertionError(f"seq_to_heads: {x.shape[2]} heads but counts={counts}")
    # rows: (H, s/p, b, d), so rank j's heads are one contiguous block of rows
    rows = x.permute(2, 0, 1, 3) if seq_dim == 0 else x.permute(2, 1, 0, 3)
    num_local_tokens, batch, head_dim = rows.shape[1:]
    heads = counts[rank]
    out = all_to_all_rows(rows, group, counts, (heads,) * num_ranks)  # (p * h_r, s/p, b, d)
    # block i holds the tokens of rank i: (p, h_r, s/p, b, d)
    out = out.view(num_ranks, heads, num_local_tokens, batch, head_dim)
    num_tokens = num_ranks * num_local_tokens
    if seq_dim == 0:
        # (p, s/p, b, h_r, d) -> (s, b, h_r, d)
        return out.permute(0, 2, 3, 1, 4).reshape(num_tokens, batch, heads, head_dim)
    # (b, p, s/p, h_r, d) -> (b, s, h_r, d)
    return out.permute(3, 0, 2, 1, 4).reshape(batch, num_tokens, heads, head_dim)


def heads_to_seq(
    x: torch.Tensor, counts: tuple[int, ...], group: Any, seq_dim: int = 0
) -> torch.Tensor:
    """Every token of this rank's ``counts[rank]`` heads -> its ``s/p`` tokens of every head."""
    _check_layout(x, seq_dim, "attention output")
    num_ranks, rank = len(counts), comm.get_rank(group)
    heads = counts[rank]
    num_tokens = x.shape[seq_dim]
    if x.shape[2] != heads:
        raise ValueError(
            f"the local attention returned {x.shape[2]} heads (shape {tuple(x.shape)}) but this "
            f"rank holds {heads} query heads; it must return (s, b, h, d) / (b, s, h, d) with the "
            "query's head count."
        )
    if num_tokens % num_ranks:
        raise AssertionError(f"heads_to_seq: {num_tokens} tokens over {num_ranks} ranks")
    num_local_tokens, head_dim = num_tokens // num_ranks, x.shape[3]
    batch = x.shape[1 - seq_dim]
    if seq_dim == 0:
        # (s, b, h_r, d) -> (p, s/p, b, h_r, d) -> (p, h_r, s/p, b, d)
        blocks = x.reshape(num_ranks, num_local_tokens, batch, heads, head_dim)
        blocks = blocks.permute(0, 3, 1, 2, 4)
    else:
        # (b, s, h_r, d) -> (b, p, s/p, h_r, d) -> (p, h_r, s/p, b, d)
        blocks = x.reshape(batch, num_ranks, num_local_tokens, heads, head_dim)
        blocks = blocks.permute(1, 3, 2, 0, 4)
    rows = blocks.reshape(num_ranks * heads, num_local_tokens, batch, head_dim)
    # (H, s/p, b, d): every rank's heads, in rank order = global head order
    out = all_to_all_rows(rows, group, (heads,) * num_ranks, counts)
    if seq_dim == 0:
        return out.permute(1, 2, 0, 3).contiguous()  # (s/p, b, H, d)
    return out.permute(2, 1, 0, 3).contiguous()  # (b, s/p, H, d)


def replicate_kv_heads(x: torch.Tensor, replicas: int) -> torch.Tensor:
    """Repeat each KV head ``replicas`` times in place order (``[k0, k0, k1, k1]``); (.., .., h*r, d)."""
    return x if replicas == 1 else x.repeat_interleave(replicas, dim=2)
