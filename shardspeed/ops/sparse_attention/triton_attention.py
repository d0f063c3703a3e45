"""Block-sparse attention on the Triton kernels: lookup tables and the autograd Function.

The layout becomes two CSR tables over the flat index ``head * num_blocks + block``::

    layout (h=0):  r0: x . x .       row_ptr = [0, 2, 3, ...]   col_idx = [0, 2, 1, ...]
                   r1: . x . .       col_ptr = [0, 1, 2, ...]   row_idx = [0, 1, 0, ...]
                   ...

``row_ptr``/``col_idx`` list each query block's key blocks (forward and ``dq``);
``col_ptr``/``row_idx`` list each key block's query blocks (``dk``/``dv``), so every program
owns its output block and the backward needs no atomics. Tables are built once per plan and
device and cached for as long as the plan lives.

Imported lazily by ``block_sparse.py``: importing this module imports ``triton``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
from torch.autograd.function import once_differentiable

from shardspeed.ops.sparse_attention import triton_kernels as kernels
from shardspeed.ops.sparse_attention.block_plan import BlockPlan


@dataclass(frozen=True)
class LookupTables:
    """CSR views of one layout (int32 tensors on the kernel's device)."""

    row_ptr: torch.Tensor  # (H*nb + 1,) start of each (head, query block) in col_idx
    col_idx: torch.Tensor  # (nnz,) key block of every non-zero block, row-major
    col_ptr: torch.Tensor  # (H*nb + 1,) start of each (head, key block) in row_idx
    row_idx: torch.Tensor  # (nnz,) query block of every non-zero block, column-major


def layout_mask(plan: BlockPlan) -> torch.Tensor:
    """The plan's layout as a bool (H, nb, nb) CPU tensor (bucket padding dropped)."""
    nb = plan.num_blocks
    mask = torch.zeros(plan.num_heads * nb, nb, dtype=torch.bool)  # (H*nb, nb)
    for bucket in plan.buckets:
        valid = bucket.valid.cpu()  # (n, M)
        rows = bucket.rows.cpu()[:, None].expand(valid.shape)  # (n, M)
        mask[rows[valid], bucket.key_blocks.cpu()[valid]] = True
    return mask.view(plan.num_heads, nb, nb)


def _csr(mask: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ptr, idx) of a bool (R, C) matrix: row r's non-zero columns are idx[ptr[r]:ptr[r+1]]."""
    counts = mask.sum(1)  # (R,)
    ptr = torch.zeros(mask.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=ptr[1:])
    idx = mask.nonzero()[:, 1]  # row-major, so ascending columns within each row
    return ptr.to(device, torch.int32), idx.to(device, torch.int32)


def kernel_tile(block: int, head_dim: int) -> int:
    """Rows/columns of the kernels' score tile: the layout block, capped so the tiles of one
    program fit in shared memory (a larger layout block is split into tile-sized blocks)."""
    return min(block, 64 if head_dim <= 128 else 32)


def build_lookup_tables(layout: torch.Tensor, device: torch.device, split: int = 1) -> LookupTables:
    """CSR tables of a (H, nb, nb) layout for the kernels on ``device``; ``split`` cuts every
    layout block into ``split x split`` kernel tiles (nb -> nb * split)."""
    mask = layout.detach().cpu() != 0
    if split > 1:  # (H, nb, nb) -> (H, nb * split, nb * split)
        mask = mask.repeat_interleave(split, 1).repeat_interleave(split, 2)
    num_heads, nb, _ = mask.shape
    row_ptr, col_idx = _csr(mask.reshape(num_heads * nb, nb), device)
    col_ptr, row_idx = _csr(mask.transpose(1, 2).reshape(num_heads * nb, nb), device)
    return LookupTables(row_ptr, col_idx, col_ptr, row_idx)


_TABLES: dict[tuple[int, torch.device, int], tuple[weakref.ref, LookupTables]] = {}


def lookup_tables(plan: BlockPlan, device: torch.device, split: int = 1) -> LookupTables:
    """The tables of ``plan`` on ``device``, built on first use and cached while it lives."""
    key = (id(plan), torch.device(device), split)
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is plan:
        return hit[1]
    tables = build_lookup_tables(layout_mask(plan), device, split)
    _TABLES[key] = (weakref.ref(plan), tables)
    weakref.finalize(plan, _TABLES.pop, key, None)
    return tables


def _bias_args(bias: torch.Tensor | None, shape: tuple[int, ...], dummy: torch.Tensor):
    """(tensor, strides...) of a bias broadcast to ``shape``; broadcast dims get stride 0."""
    if bias is None:
        return (dummy, *([0] * len(shape)))
    view = bias.expand(shape)
    return (view, *view.stride())


def _launch_options(tile: int, block_d: int, dtype: torch.dtype) -> dict[str, int]:
    """Fewer software-pipeline stages for larger tiles, so that the staged K/V (Q/dO) tiles
    and the layout conversions of the score tile stay within an A100's shared memory."""
    tile_bytes = tile * block_d * dtype.itemsize  # one (tile, BLOCK_D) operand
    num_stages = 3 if tile_bytes <= 8192 else 2 if tile_bytes <= 16384 else 1
    return dict(num_warps=4, num_stages=num_stages)


def _dot_precision(query: torch.Tensor) -> str:
    """fp32 GEMMs follow torch's TF32 switch on CUDA (off by default: exact fp32)."""
    if query.is_cuda and query.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


class _TritonBlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None,
        key_padding_bias: torch.Tensor | None,
        attn_bias: torch.Tensor | None,
        tables: LookupTables,
        scale: float,
    ) -> torch.Tensor:
        q, k, v = (t.contiguous() for t in (query, key, value))  # (B, H, L, D)
        batch, num_heads, seq_len, head_dim = q.shape
        nb = (tables.row_ptr.numel() - 1) // num_heads
        square = (batch, num_heads, seq_len, seq_len)
        biases = (
            *_bias_args(rpe, square, q),
            *_bias_args(key_padding_bias, (batch, seq_len), q),
            *_bias_args(attn_bias, square, q),
        )
        tile = seq_len // nb
        block_d = max(16, triton.next_power_of_2(head_dim))
        meta = dict(
            BLOCK=tile,
            BLOCK_D=block_d,
            HAS_RPE=rpe is not None,
            HAS_KP=key_padding_bias is not None,
            HAS_AM=attn_bias is not None,
            DOT_PRECISION=_dot_precision(q),
            **_launch_options(tile, block_d, q.dtype),
        )
        out = torch.empty_like(q)
        lse = torch.empty(batch, num_heads, seq_len, dtype=torch.float32, device=q.device)
        kernels.block_sparse_forward[(nb, batch * num_heads)](
            q, k, v, out, lse, tables.row_ptr, tables.col_idx, *biases,
            scale, num_heads, seq_len, head_dim, nb, **meta,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, rpe, key_padding_bias, attn_bias)
        ctx.tables = tables
        ctx.scale = scale
        ctx.meta = meta
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, rpe, key_padding_bias, attn_bias = ctx.saved_tensors
        tables: LookupTables = ctx.tables
        batch, num_heads, seq_len, head_dim = q.shape
        nb = (tables.row_ptr.numel() - 1) // num_heads
        square = (batch, num_heads, seq_len, seq_len)
        biases = (
            *_bias_args(rpe, square, q),
            *_bias_args(key_padding_bias, (batch, seq_len), q),
            *_bias_args(attn_bias, square, q),
        )
        d_out = grad_out.contiguous()
        delta = (d_out.float() * out.float()).sum(-1)  # (B, H, L): rowsum(dO * O)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        want_rpe = rpe is not None and ctx.needs_input_grad[3]
        # ds of every computed block, as (B, H, L, L); blocks outside the layout stay 0
        d_rpe_full = torch.zeros(square, dtype=torch.float32, device=q.device) if want_rpe else q
        grid = (nb, batch * num_heads)
        common = (ctx.scale, num_heads, seq_len, head_dim, nb)
        kernels.block_sparse_backward_dq[grid](
            q, k, v, d_out, lse, delta, dq, d_rpe_full, tables.row_ptr, tables.col_idx,
            *biases, *common, WRITE_DRPE=want_rpe, **ctx.meta,
        )  # fmt: skip
        kernels.block_sparse_backward_dkdv[grid](
            q, k, v, d_out, lse, delta, dk, dv, tables.col_ptr, tables.row_idx,
            *biases, *common, **ctx.meta,
        )  # fmt: skip
        d_rpe = None
        if want_rpe:
            broadcast = [dim for dim in (0, 1) if rpe.shape[dim] == 1 and square[dim] > 1]
            if broadcast:
                d_rpe_full = d_rpe_full.sum(broadcast, keepdim=True)  # (B'|1, H'|1, L, L)
            d_rpe = d_rpe_full.to(rpe.dtype)
        return dq, dk, dv, d_rpe, None, None, None, None


def triton_block_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: BlockPlan,
    *,
    scale: float,
    rpe: torch.Tensor | None = None,
    key_padding_bias: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-sparse attention of validated (B, H, L, D) inputs on the Triton kernels.

    Same contract as :func:`~shardspeed.ops.sparse_attention.block_sparse_attention` (which
    validates the arguments and picks this kernel): biases are additive, ``rpe`` is
    (B|1, H|1, L, L) and gets a gradient, rows with no allowed key output zeros.
    """
    block = query.shape[2] // plan.num_blocks
    tables = lookup_tables(plan, query.device, block // kernel_tile(block, query.shape[3]))
    return _TritonBlockSparseAttention.apply(
        query, key, value, rpe, key_padding_bias, attn_bias, tables, float(scale)
    )
