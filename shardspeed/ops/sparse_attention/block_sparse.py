"""Block-sparse attention in plain PyTorch: only the layout's blocks are computed.

Inputs are viewed as rows of blocks, ``(B, H, L, D) -> (B*H*nb, b, D)``: one row per (batch,
head, query block). For each bucket of rows (see ``block_plan.py``), a chunk of rows at a
time::

    q_rows = q[rows] * scale                         # (N, b, D)      N = rows in the chunk
    k_cat  = k[cols];  v_cat = v[cols]               # (N, M*b, D)    the rows' key blocks
    s      = q_rows @ k_cat^T + biases               # (N, b, M*b)    padding slots -> -inf
    out[rows] = softmax(s) @ v_cat ;  lse[rows] = logsumexp(s)

Backward recomputes ``p = exp(s - lse)`` chunk by chunk (as FlashAttention does), so memory
stays at the inputs, the output and one chunk's working set whatever the sequence length,
and work scales with the number of non-zero blocks. ``dq`` is written row by row; ``dk`` and
``dv`` are accumulated with ``index_add_`` over the gathered key blocks.

Masks arrive here already additive (0 keeps, -inf drops); the module converts DeepSpeed's
``add``/``mul`` modes. A query row whose every allowed score is -inf (no block in the layout,
or every key masked) outputs zeros and gets zero gradients, where dense softmax gives NaN.

:func:`block_sparse_attention` is the entry point of both kernels: on CUDA it runs the fused
Triton kernel (``triton_attention.py``) when Triton is available; ``kernel_choice.py`` says
when and how to force either.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from shardspeed.ops.sparse_attention.block_plan import BlockPlan, RowBucket, build_plan
from shardspeed.ops.sparse_attention.kernel_choice import choose_kernel

DEFAULT_CHUNK_ELEMENTS = 1 << 19
"""Elements in the largest per-chunk tensor (2 MiB in fp32): the working set of one chunk is a
few of these, small next to the inputs, and large enough that each GEMM stays efficient."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class _Chunk:
    """A slice of one bucket, for every batch element: indices into the (B*H*nb) rows."""

    bucket: RowBucket  # n rows of the layout, with M key blocks each
    rows: torch.Tensor  # (B*n,) batch-major: batch * H*nb + layout row
    cols: torch.Tensor  # (B*n*M,) the key-block row of every slot, same order

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.bucket.cols.shape)  # (n, M)


def _chunks(
    plan: BlockPlan, batch: int, block: int, head_dim: int, chunk_elements: int
) -> Iterator[_Chunk]:
    rows_per_batch = plan.num_heads * plan.num_blocks
    for bucket in plan.buckets:
        per_row = batch * bucket.max_cols * block * max(block, head_dim)
        step = max(1, chunk_elements // per_row)
        offsets = torch.arange(batch, device=bucket.rows.device) * rows_per_batch  # (B,)
        for start in range(0, bucket.num_rows, step):
            part = bucket.slice(start, start + step)
            rows = (offsets[:, None] + part.rows[None, :]).flatten()
            cols = (offsets[:, None, None] + part.cols[None, :, :]).flatten()
            yield _Chunk(part, rows, cols)


def _bias_blocks(bias: torch.Tensor, part: RowBucket, num_blocks: int) -> torch.Tensor:
    """The rows' blocks of a (B'|1, H'|1, L, L) bias, as (B', n, b, M*b)."""
    batch, heads, seq_len, _ = bias.shape
    block = seq_len // num_blocks
    # (B', H', nb, b, nb, b) -> (B', H', nb_q, nb_k, b_q, b_k): a view, no copy
    blocks = bias.view(batch, heads, num_blocks, block, num_blocks, block).permute(0, 1, 2, 4, 3, 5)
    head_idx = part.heads if heads > 1 else torch.zeros_like(part.heads)
    picked = blocks[:, head_idx[:, None], part.query_blocks[:, None], part.key_blocks]
    # picked: (B', n, M, b_q, b_k) -> (B', n, b_q, M * b_k)
    n, m = part.key_blocks.shape
    return picked.permute(0, 1, 3, 2, 4).reshape(batch, n, block, m * block)


def _add_bias_grad(grad: torch.Tensor, ds: torch.Tensor, part: RowBucket, num_blocks: int):
    """Accumulate ``ds`` (B, n, b, M*b) into the (B'|1, H'|1, L, L) bias gradient."""
    batch, heads, seq_len, _ = grad.shape
    block = seq_len // num_blocks
    n, m = part.key_blocks.shape
    values = ds.view(ds.shape[0], n, block, m, block).permute(1, 3, 0, 2, 4)  # (n, M, B, b, b)
    if batch == 1 and ds.shape[0] > 1:
        values = values.sum(2, keepdim=True)
    # (H', nb_q, nb_k, B', b_q, b_k) view of the gradient, indexed by its leading three dims
    target = grad.view(batch, heads, num_blocks, block, num_blocks, block).permute(1, 2, 4, 0, 3, 5)
    head_idx = part.heads if heads > 1 else torch.zeros_like(part.heads)
    index = (
        head_idx[:, None].expand(n, m),
        part.query_blocks[:, None].expand(n, m),
        part.key_blocks,
    )
    # Padding slots repeat a real key block with a zero value, so accumulate (never overwrite).
    target.index_put_(index, values.to(grad.dtype), accumulate=True)


def _gemm_minus(offset: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b - offset`` in the accumulation dtype; ``offset`` (N, rows, 1) is per row.

    In fp32/fp64 the subtraction rides in the GEMM (``baddbmm``) instead of a separate pass.
    """
    acc = _acc_dtype(a.dtype)
    if offset is None:
        return torch.bmm(a, b).to(acc)
    if a.dtype == acc:
        return torch.baddbmm(offset.neg(), a, b)
    return torch.bmm(a, b).to(acc).sub_(offset)


@dataclass(frozen=True)
class _Biases:
    """Additive terms of the scores; each may be None."""

    rpe: torch.Tensor | None  # (B'|1, H'|1, L, L)
    key_padding: torch.Tensor | None  # (B, L)
    attn: torch.Tensor | None  # (B'|1, H'|1, L, L)


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    chunk: _Chunk,
    batch: int,
    num_blocks: int,
    biases: _Biases,
    scale: float,
    row_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores of a chunk minus ``row_offset``: (B*n, b, M*b) in the accumulation dtype.

    Also returns the gathered, scaled ``q_rows`` (B*n, b, D) and ``k_cat`` (B*n, M*b, D) for
    the backward pass to reuse.
    """
    _, block, head_dim = q.shape
    n, m = chunk.shape
    q_rows = q.index_select(0, chunk.rows).mul_(scale)  # (B*n, b, D); scales every score
    k_cat = k.index_select(0, chunk.cols).view(batch * n, m * block, head_dim)
    s = _gemm_minus(row_offset, q_rows, k_cat.transpose(1, 2))  # (B*n, b, M*b)
    by_batch = s.view(batch, n, block, m * block)
    part = chunk.bucket
    if biases.rpe is not None:
        by_batch.add_(_bias_blocks(biases.rpe, part, num_blocks))
    if biases.key_padding is not None:
        kp = biases.key_padding.view(batch, num_blocks, block)
        kp = kp.index_select(1, part.key_blocks.flatten()).view(batch, n, 1, m * block)
        by_batch.add_(kp)  # the same for every query row
    if biases.attn is not None:
        by_batch.add_(_bias_blocks(biases.attn, part, num_blocks))
    if part.has_padding:
        pad = ~part.valid.view(1, n, 1, m, 1)
        s.view(batch, n, block, m, block).masked_fill_(pad, float("-inf"))
    return s, q_rows, k_cat


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None,
        key_padding_bias: torch.Tensor | None,
        attn_bias: torch.Tensor | None,
        plan: BlockPlan,
        scale: float,
        chunk_elements: int,
    ) -> torch.Tensor:
        batch, num_heads, seq_len, head_dim = query.shape
        nb = plan.num_blocks
        block = seq_len // nb
        # (B, H, L, D) -> (B*H*nb, b, D): one row of blocks per (batch, head, query block)
        rows_shape = (batch * num_heads * nb, block, head_dim)
        q, k, v = (t.reshape(rows_shape) for t in (query, key, value))
        biases = _Biases(rpe, key_padding_bias, attn_bias)
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(rows_shape, dtype=query.dtype, device=query.device)
        lse = torch.full(rows_shape[:2], float("inf"), dtype=acc, device=q.device)  # (rows, b)

        for chunk in _chunks(plan, batch, block, head_dim, chunk_elements):
            s, _, _ = _scores(q, k, chunk, batch, nb, biases, scale)
            row_lse = torch.logsumexp(s, dim=-1)  # (B*n, b)
            p = torch.softmax(s, dim=-1)  # (B*n, b, M*b)
            empty = row_lse == float("-inf")  # every allowed score was -inf
            if bool(empty.any()):
                p.masked_fill_(empty.unsqueeze(-1), 0.0)  # softmax gave NaN there
                row_lse.masked_fill_(empty, float("inf"))  # so exp(s - lse) = 0 in backward
            v_cat = v.index_select(0, chunk.cols).view(p.shape[0], -1, head_dim)  # (B*n, M*b, D)
            out.index_copy_(0, chunk.rows, torch.bmm(p.to(v.dtype), v_cat))
            lse.index_copy_(0, chunk.rows, row_lse)
            del s, p, v_cat  # free the chunk before the next one is gathered

        ctx.save_for_backward(query, key, value, rpe, key_padding_bias, attn_bias, out, lse)
        ctx.plan = plan
        ctx.scale = scale
        ctx.chunk_elements = chunk_elements
        return out.view(batch, num_heads, seq_len, head_dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        query, key, value, rpe, key_padding_bias, attn_bias, out, lse = ctx.saved_tensors
        plan: BlockPlan = ctx.plan
        batch, num_heads, seq_len, head_dim = key.shape
        nb = plan.num_blocks
        block = seq_len // nb
        rows_shape = out.shape  # (B*H*nb, b, D)
        q, k, v = (t.reshape(rows_shape) for t in (query, key, value))
        d_out = grad_out.reshape(rows_shape)
        biases = _Biases(rpe, key_padding_bias, attn_bias)
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros(rows_shape, dtype=acc, device=q.device)
        dk = torch.zeros_like(dq)
        dv = torch.zeros_like(dq)
        d_rpe = None
        if rpe is not None and ctx.needs_input_grad[3]:
            d_rpe = torch.zeros(rpe.shape, dtype=acc, device=rpe.device)

        for chunk in _chunks(plan, batch, block, head_dim, ctx.chunk_elements):
            n, m = chunk.shape
            lse_rows = lse.index_select(0, chunk.rows).unsqueeze(-1)  # (B*n, b, 1)
            s, q_rows, k_cat = _scores(q, k, chunk, batch, nb, biases, ctx.scale, lse_rows)
            p = s.exp_()  # (B*n, b, M*b): the forward's probabilities, recomputed
            do_rows = d_out.index_select(0, chunk.rows)  # (B*n, b, D)
            out_rows = out.index_select(0, chunk.rows)
            delta_rows = (do_rows.to(acc) * out_rows).sum(-1, keepdim=True)  # rowsum(dO * O)
            v_cat = v.index_select(0, chunk.cols).view(batch * n, m * block, head_dim)

            dv_cat = torch.bmm(p.transpose(1, 2).to(v.dtype), do_rows)  # (B*n, M*b, D)
            dv.index_add_(0, chunk.cols, dv_cat.view(-1, block, head_dim).to(acc))
            del dv_cat

            ds = p.mul_(_gemm_minus(delta_rows, do_rows, v_cat.transpose(1, 2)))
            del v_cat
            # ds = P * (dP - delta), the gradient of the scores: (B*n, b, M*b)
            if d_rpe is not None:
                _add_bias_grad(d_rpe, ds.view(batch, n, block, m * block), chunk.bucket, nb)
            ds = ds.to(q.dtype)

            dq.index_copy_(0, chunk.rows, torch.bmm(ds, k_cat).to(acc))  # times scale below
            dk_cat = torch.bmm(ds.transpose(1, 2), q_rows)  # (B*n, M*b, D); q is scaled
            dk.index_add_(0, chunk.cols, dk_cat.view(-1, block, head_dim).to(acc))
            del s, p, ds, k_cat, dk_cat  # free the chunk before the next one is gathered

        full = (batch, num_heads, seq_len, head_dim)
        return (
            dq.mul_(ctx.scale).view(full).to(q.dtype),
            dk.view(full).to(key.dtype),
            dv.view(full).to(value.dtype),
            None if d_rpe is None else d_rpe.to(rpe.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _as_4d_bias(name: str, bias: torch.Tensor, batch: int, num_heads: int, seq_len: int):
    """A (L, L), (B, L, L) or (B|1, H|1, L, L) bias as 4-D fp32."""
    if bias.dim() == 2:
        bias = bias.view(1, 1, *bias.shape)
    elif bias.dim() == 3:
        bias = bias.unsqueeze(1)
    ok = (
        bias.dim() == 4
        and bias.shape[0] in (1, batch)
        and bias.shape[1] in (1, num_heads)
        and tuple(bias.shape[2:]) == (seq_len, seq_len)
    )
    if not ok:
        raise ValueError(
            f"{name} has shape {tuple(bias.shape)}; expected (L, L), (B, L, L) or "
            f"(B|1, H|1, L, L) with B={batch}, H={num_heads}, L={seq_len}."
        )
    return bias


def block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: torch.Tensor | BlockPlan,
    *,
    scale: float | None = None,
    rpe: torch.Tensor | None = None,
    key_padding_bias: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    kernel: str | None = None,
) -> torch.Tensor:
    """Attention of (B, H, L, D) inputs restricted to ``layout``'s blocks.

    Args:
        layout: (H, L/b, L/b) block layout, or a :class:`BlockPlan` built from one (reuse a
            plan across calls; building it costs a sort of the layout).
        scale: multiplies ``q @ k^T``; default ``D ** -0.5``.
        rpe: additive (B|1, H|1, L, L) bias (relative position embedding); gets a gradient.
        key_padding_bias: additive (B, L) bias applied to every query row.
        attn_bias: additive (L, L), (B, L, L) or (B|1, H|1, L, L) bias; no gradient.
        chunk_elements: size of the per-chunk working set of the PyTorch kernel; smaller
            saves memory (the Triton kernel works one block at a time and has no chunks).
        kernel: ``"auto"`` (Triton on CUDA when available, else PyTorch), ``"triton"`` or
            ``"torch"``; default: env ``SHARDSPEED_SPARSE_ATTENTION_KERNEL``, else auto.
            See ``kernel_choice.py``.

    Returns:
        (B, H, L, D) attention output; rows with no allowed key are zero.
    """
    plan = layout if isinstance(layout, BlockPlan) else build_plan(layout)
    if query.dim() != 4 or query.shape != key.shape or key.shape != value.shape:
        raise ValueError(
            "query, key and value must all be (batch, heads, seq_len, head_dim) with the same "
            f"shape; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, "
            f"{value.dtype}."
        )
    batch, num_heads, seq_len, head_dim = query.shape
    if num_heads != plan.num_heads or seq_len % plan.num_blocks != 0:
        raise ValueError(
            f"layout is for {plan.num_heads} heads x {plan.num_blocks} blocks but the input has "
            f"{num_heads} heads and sequence length {seq_len}; build the layout with "
            "make_layout(seq_len) of a config whose num_heads matches the input."
        )
    use_triton = choose_kernel(kernel, query, seq_len // plan.num_blocks) == "triton"
    if not use_triton and plan.buckets and plan.buckets[0].rows.device != query.device:
        plan = plan.to(query.device)
    if scale is None:
        scale = head_dim**-0.5
    if rpe is not None:
        rpe = _as_4d_bias("rpe", rpe, batch, num_heads, seq_len)
    if attn_bias is not None:
        attn_bias = _as_4d_bias("attn_mask", attn_bias, batch, num_heads, seq_len)
    if key_padding_bias is not None:
        if tuple(key_padding_bias.shape) != (batch, seq_len):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_bias.shape)}; expected "
                f"(batch, seq_len) = ({batch}, {seq_len})."
            )
    if use_triton:
        from shardspeed.ops.sparse_attention.triton_attention import (
            triton_block_sparse_attention,
        )

        return triton_block_sparse_attention(
            query, key, value, plan, scale=scale, rpe=rpe,
            key_padding_bias=key_padding_bias, attn_bias=attn_bias,
        )  # fmt: skip
    return _BlockSparseAttention.apply(
        query, key, value, rpe, key_padding_bias, attn_bias, plan, float(scale), chunk_elements
    )
