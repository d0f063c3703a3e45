"""From a block layout to the gather plan the block-sparse kernel runs.

The kernel works on *rows*: one row is one query block of one head, flattened as
``row = head * num_blocks + query_block``. Each row attends to a short list of key blocks (the
layout's non-zero columns). Rows are grouped into buckets of similar length; inside a bucket
every row's list is padded to the bucket's longest, so a bucket is a dense
``(num_rows, max_cols)`` table of key blocks (ELL format)::

    layout row (h=0, r=2):  . x x . . . . x      -> cols [1, 2, 7]
    layout row (h=0, r=5):  x . . . x x x .      -> cols [0, 4, 5, 6]
    bucket (max_cols=4):    rows [2, 5]; cols [[1, 2, 7, 1], [0, 4, 5, 6]]; valid [[1,1,1,0], [1,1,1,1]]

A bucket turns the attention of all its rows into two batched matmuls (no scatter in the
forward pass), and padding wastes at most ``1 - BUCKET_FILL`` of a bucket's work. Rows with
no block at all are in no bucket: their output is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUCKET_FILL = 0.75
"""A row joins the current bucket while its length is >= BUCKET_FILL * the bucket's longest."""


@dataclass(frozen=True)
class RowBucket:
    """Rows of similar length, their key blocks padded to ``max_cols`` (all int64 tensors)."""

    rows: torch.Tensor  # (num_rows,) flat row index: head * num_blocks + query_block
    heads: torch.Tensor  # (num_rows,) head of each row
    query_blocks: torch.Tensor  # (num_rows,) query block of each row
    key_blocks: torch.Tensor  # (num_rows, max_cols) key block; padding repeats a real one
    cols: torch.Tensor  # (num_rows, max_cols) flat key index: head * num_blocks + key_block
    valid: torch.Tensor  # (num_rows, max_cols) bool, False on padding
    has_padding: bool

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    @property
    def max_cols(self) -> int:
        return self.cols.shape[1]

    def slice(self, start: int, end: int) -> RowBucket:
        """Rows ``[start, end)`` of this bucket (views, no copy)."""
        valid = self.valid[start:end]
        return RowBucket(
            rows=self.rows[start:end],
            heads=self.heads[start:end],
            query_blocks=self.query_blocks[start:end],
            key_blocks=self.key_blocks[start:end],
            cols=self.cols[start:end],
            valid=valid,
            has_padding=self.has_padding and not bool(valid.all()),
        )

    def to(self, device: torch.device) -> RowBucket:
        return RowBucket(
            rows=self.rows.to(device),
            heads=self.heads.to(device),
            query_blocks=self.query_blocks.to(device),
            key_blocks=self.key_blocks.to(device),
            cols=self.cols.to(device),
            valid=self.valid.to(device),
            has_padding=self.has_padding,
        )


@dataclass(frozen=True)
class BlockPlan:
    """Everything the kernel needs to know about one layout."""

    num_heads: int
    num_blocks: int
    nnz_blocks: int  # non-zero blocks over all heads (the work the kernel does)
    buckets: tuple[RowBucket, ...]

    @property
    def density(self) -> float:
        return self.nnz_blocks / max(self.num_heads * self.num_blocks**2, 1)

    @property
    def padded_blocks(self) -> int:
        """Blocks computed including bucket padding (>= nnz_blocks)."""
        return sum(b.num_rows * b.max_cols for b in self.buckets)

    def to(self, device: torch.device) -> BlockPlan:
        return BlockPlan(
            self.num_heads,
            self.num_blocks,
            self.nnz_blocks,
            tuple(b.to(device) for b in self.buckets),
        )


def _bucket_bounds(lengths: list[int]) -> list[tuple[int, int]]:
    """[start, end) runs of ``lengths`` (sorted descending) that share a bucket."""
    bounds = []
    start = 0
    while start < len(lengths):
        end = start + 1
        while end < len(lengths) and lengths[end] >= BUCKET_FILL * lengths[start]:
            end += 1
        bounds.append((start, end))
        start = end
    return bounds


def build_plan(layout: torch.Tensor) -> BlockPlan:
    """The bucketed gather plan of ``layout`` (num_heads, num_blocks, num_blocks)."""
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(
            f"layout must be (num_heads, num_blocks, num_blocks), got shape {tuple(layout.shape)}."
        )
    num_heads, num_blocks, _ = layout.shape
    mask = layout.detach().to("cpu") != 0  # (H, nb, nb)
    lengths = mask.sum(-1).flatten()  # (H * nb,) key blocks per row
    order = torch.argsort(lengths, descending=True, stable=True)
    nonempty = order[lengths[order] > 0]
    sorted_lengths = lengths[nonempty].tolist()

    # Column lists, longest row first; padding slots take the row's first column.
    flat_mask = mask.view(num_heads * num_blocks, num_blocks)
    key_positions = torch.arange(num_blocks).expand(num_heads * num_blocks, num_blocks)

    buckets = []
    for start, end in _bucket_bounds(sorted_lengths):
        rows = nonempty[start:end]  # (n,)
        max_cols = sorted_lengths[start]
        row_mask = flat_mask[rows]  # (n, nb)
        # Stable sort puts each row's key blocks first, in ascending order.
        ranked = torch.argsort((~row_mask).to(torch.int8), dim=1, stable=True)  # (n, nb)
        key_blocks = torch.gather(key_positions[: rows.numel()], 1, ranked)[:, :max_cols]
        valid = torch.gather(row_mask, 1, ranked)[:, :max_cols]  # (n, max_cols)
        key_blocks = torch.where(valid, key_blocks, key_blocks[:, :1])
        heads = rows // num_blocks
        buckets.append(
            RowBucket(
                rows=rows.clone(),
                heads=heads,
                query_blocks=rows % num_blocks,
                key_blocks=key_blocks.contiguous(),
                cols=(heads.unsqueeze(1) * num_blocks + key_blocks).contiguous(),
                valid=valid.contiguous(),
                has_padding=not bool(valid.all()),
            )
        )
    return BlockPlan(num_heads, num_blocks, int(mask.sum()), tuple(buckets))
