"""Triton kernels of block-sparse attention: a fused forward and a two-kernel backward.

Imported lazily (only when the Triton kernel is chosen): importing this module imports
``triton``. Triton reads ``TRITON_INTERPRET`` when a kernel is decorated: when ``triton``
itself is first imported (its own helpers) and when this module is; :data:`INTERPRETED`
records whether both were built for the interpreter.

Every program handles one block of one (batch, head) and walks a CSR list of the blocks it
meets (built from the layout by ``triton_attention.py``), FlashAttention-style::

    forward  (query block r):  for c in cols[r]:  s = q_r k_c^T * scale + biases
                                                  online softmax; acc += p v_c
                               out_r = acc / l;  lse_r = m + log(l)   (+inf for an empty row)
    dq       (query block r):  for c in cols[r]:  p = exp(s - lse_r); ds = p * (do_r v_c^T - delta_r)
                                                  dq += ds k_c           (ds -> d_rpe if asked)
    dk, dv   (key block c):    for r in rows[c]:  dv += p^T do_r;  dk += ds^T q_r

Each output block is written by exactly one program: no atomics, deterministic results.
Inputs are contiguous (B, H, L, D); head_dim is padded to ``BLOCK_D`` (a power of two) with
masked loads. Biases are (B, H, L, L) views with broadcast dimensions at stride 0 and
``key_padding`` is (B, L); all three are added in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add_biases(
    s,
    b,
    h,
    rows,
    cols,
    Rpe,
    rpe_sb,
    rpe_sh,
    rpe_sm,
    rpe_sn,
    Kp,
    kp_sb,
    kp_sn,
    Am,
    am_sb,
    am_sh,
    am_sm,
    am_sn,
    HAS_RPE: tl.constexpr,
    HAS_KP: tl.constexpr,
    HAS_AM: tl.constexpr,
):
    """``s`` (BLOCK, BLOCK) plus the additive biases at token ``rows`` x ``cols``."""
    if HAS_RPE:
        rpe = Rpe + b * rpe_sb + h * rpe_sh + rows[:, None] * rpe_sm + cols[None, :] * rpe_sn
        s += tl.load(rpe).to(tl.float32)
    if HAS_KP:
        s += tl.load(Kp + b * kp_sb + cols * kp_sn).to(tl.float32)[None, :]
    if HAS_AM:
        am = Am + b * am_sb + h * am_sh + rows[:, None] * am_sm + cols[None, :] * am_sn
        s += tl.load(am).to(tl.float32)
    return s


@triton.jit
def block_sparse_forward(
    Q,
    K,
    V,
    Out,
    Lse,
    RowPtr,
    ColIdx,
    Rpe,
    rpe_sb,
    rpe_sh,
    rpe_sm,
    rpe_sn,
    Kp,
    kp_sb,
    kp_sn,
    Am,
    am_sb,
    am_sh,
    am_sm,
    am_sn,
    scale,
    num_heads,
    seq_len,
    head_dim,
    num_blocks,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RPE: tl.constexpr,
    HAS_KP: tl.constexpr,
    HAS_AM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (num_blocks, B*H): output and log-sum-exp of one query block."""
    query_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < head_dim
    base = bh * seq_len * head_dim  # start of this (batch, head) in (B, H, L, D)
    rows = query_block * BLOCK + offs
    q_tile = base + rows[:, None] * head_dim + offs_d[None, :]
    q = tl.load(Q + q_tile, mask=d_mask, other=0.0)  # (BLOCK, BLOCK_D)

    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # running row max
    l_i = tl.zeros([BLOCK], dtype=tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    row = h * num_blocks + query_block
    start = tl.load(RowPtr + row)
    end = tl.load(RowPtr + row + 1)
    for i in range(start, end):
        key_block = tl.load(ColIdx + i)
        cols = key_block * BLOCK + offs
        kv_tile = base + cols[:, None] * head_dim + offs_d[None, :]
        k = tl.load(K + kv_tile, mask=d_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (BLOCK, BLOCK)
        s = _add_biases(
            s, b, h, rows, cols, Rpe, rpe_sb, rpe_sh, rpe_sm, rpe_sn, Kp, kp_sb, kp_sn,
            Am, am_sb, am_sh, am_sm, am_sn, HAS_RPE, HAS_KP, HAS_AM,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row all -inf so far
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_tile, mask=d_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0  # no block, or every allowed score was -inf: output 0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(Out + q_tile, out.to(Out.dtype.element_ty), mask=d_mask)
    tl.store(Lse + bh * seq_len + rows, lse)


@triton.jit
def block_sparse_backward_dq(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    DRpe,
    RowPtr,
    ColIdx,
    Rpe,
    rpe_sb,
    rpe_sh,
    rpe_sm,
    rpe_sn,
    Kp,
    kp_sb,
    kp_sn,
    Am,
    am_sb,
    am_sh,
    am_sm,
    am_sn,
    scale,
    num_heads,
    seq_len,
    head_dim,
    num_blocks,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RPE: tl.constexpr,
    HAS_KP: tl.constexpr,
    HAS_AM: tl.constexpr,
    WRITE_DRPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (num_blocks, B*H): dq of one query block (and its ds blocks into DRpe)."""
    query_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < head_dim
    base = bh * seq_len * head_dim
    rows = query_block * BLOCK + offs
    q_tile = base + rows[:, None] * head_dim + offs_d[None, :]
    q = tl.load(Q + q_tile, mask=d_mask, other=0.0)
    do = tl.load(DOut + q_tile, mask=d_mask, other=0.0)
    lse = tl.load(Lse + bh * seq_len + rows)  # (BLOCK,) +inf on empty rows: p = 0
    delta = tl.load(Delta + bh * seq_len + rows)  # rowsum(dO * O)

    dq = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    row = h * num_blocks + query_block
    start = tl.load(RowPtr + row)
    end = tl.load(RowPtr + row + 1)
    for i in range(start, end):
        key_block = tl.load(ColIdx + i)
        cols = key_block * BLOCK + offs
        kv_tile = base + cols[:, None] * head_dim + offs_d[None, :]
        k = tl.load(K + kv_tile, mask=d_mask, other=0.0)
        v = tl.load(V + kv_tile, mask=d_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = _add_biases(
            s, b, h, rows, cols, Rpe, rpe_sb, rpe_sh, rpe_sm, rpe_sn, Kp, kp_sb, kp_sn,
            Am, am_sb, am_sh, am_sm, am_sn, HAS_RPE, HAS_KP, HAS_AM,
        )  # fmt: skip
        p = tl.exp(s - lse[:, None])  # the forward's probabilities
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])  # gradient of the biased scores
        if WRITE_DRPE:
            d_rpe = DRpe + bh * seq_len * seq_len + rows[:, None] * seq_len + cols[None, :]
            tl.store(d_rpe, ds)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    tl.store(DQ + q_tile, (dq * scale).to(DQ.dtype.element_ty), mask=d_mask)


@triton.jit
def block_sparse_backward_dkdv(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    ColPtr,
    RowIdx,
    Rpe,
    rpe_sb,
    rpe_sh,
    rpe_sm,
    rpe_sn,
    Kp,
    kp_sb,
    kp_sn,
    Am,
    am_sb,
    am_sh,
    am_sm,
    am_sn,
    scale,
    num_heads,
    seq_len,
    head_dim,
    num_blocks,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_RPE: tl.constexpr,
    HAS_KP: tl.constexpr,
    HAS_AM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (num_blocks, B*H): dk and dv of one key block, over the query blocks that see it."""
    key_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d[None, :] < head_dim
    base = bh * seq_len * head_dim
    cols = key_block * BLOCK + offs
    kv_tile = base + cols[:, None] * head_dim + offs_d[None, :]
    k = tl.load(K + kv_tile, mask=d_mask, other=0.0)
    v = tl.load(V + kv_tile, mask=d_mask, other=0.0)

    dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    column = h * num_blocks + key_block
    start = tl.load(ColPtr + column)
    end = tl.load(ColPtr + column + 1)
    for i in range(start, end):
        query_block = tl.load(RowIdx + i)
        rows = query_block * BLOCK + offs
        q_tile = base + rows[:, None] * head_dim + offs_d[None, :]
        q = tl.load(Q + q_tile, mask=d_mask, other=0.0)
        do = tl.load(DOut + q_tile, mask=d_mask, other=0.0)
        lse = tl.load(Lse + bh * seq_len + rows)
        delta = tl.load(Delta + bh * seq_len + rows)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = _add_biases(
            s, b, h, rows, cols, Rpe, rpe_sb, rpe_sh, rpe_sm, rpe_sn, Kp, kp_sb, kp_sn,
            Am, am_sb, am_sh, am_sm, am_sn, HAS_RPE, HAS_KP, HAS_AM,
        )  # fmt: skip
        p = tl.exp(s - lse[:, None])  # (BLOCK_q, BLOCK_k)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
    tl.store(DK + kv_tile, (dk * scale).to(DK.dtype.element_ty), mask=d_mask)
    tl.store(DV + kv_tile, dv.to(DV.dtype.element_ty), mask=d_mask)


INTERPRETED: bool = all(
    type(fn).__name__ == "InterpretedFunction" for fn in (block_sparse_forward, tl.zeros)
)
"""True when the kernels above and Triton's own helpers (``tl.zeros`` is one) run in Triton's
CPU interpreter: TRITON_INTERPRET=1 was set before ``triton`` was first imported."""
