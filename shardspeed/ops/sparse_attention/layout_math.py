"""Pure block-layout math: the building blocks every sparsity pattern is made of.

A layout is an int64 tensor ``(num_heads, num_blocks, num_blocks)``; entry ``[h, r, c]`` is 1
when query block ``r`` of head ``h`` attends to key block ``c``. Every function here fills one
head's ``(num_blocks, num_blocks)`` view in place and touches nothing else, so the patterns
compose by calling several of them on the same head::

    key block ->   0 1 2 3 4 5 6 7
    query 0        x x x x . . . x      local windows of 4 (bidirectional)
    query 1        x x x x . . . x      + the last block of every window as a
    query 2        x x x x . . . x        global column ("fixed", Child et al. 2019)
    query 3        x x x x . . . x
    query 4        . . . x x x x x
    ...

No randomness is drawn here except in :func:`set_random_blocks`, which takes the generator as
an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Sampler(Protocol):
    """Anything with ``random.sample``'s signature: a ``random.Random`` or the module."""

    def sample(self, population: Sequence[int], k: int) -> list[int]: ...


ATTENTION_TYPES = ("bidirectional", "unidirectional")


def is_causal(attention: str) -> bool:
    """True for ``"unidirectional"``; raises for anything but the two attention types."""
    if attention not in ATTENTION_TYPES:
        raise ValueError(
            f"attention={attention!r} is not supported; use 'bidirectional' (every block may "
            "attend to every other) or 'unidirectional' (causal: only to earlier blocks)."
        )
    return attention == "unidirectional"


def num_blocks_for(seq_len: int, block: int) -> int:
    """Number of blocks in a sequence; the sequence must be a whole number of blocks."""
    if seq_len % block != 0:
        raise ValueError(
            f"Sequence length {seq_len} is not a multiple of the block size {block}; pad the "
            "input (SparseAttentionUtils.pad_to_block_size) or pick a block size that divides it."
        )
    return seq_len // block


def set_local_windows(head: torch.Tensor, window_sizes: Sequence[int], causal: bool) -> None:
    """Tile the diagonal with windows; every block attends to the blocks of its own window.

    Window ``i`` has ``window_sizes[i]`` blocks; once the list is used up its last size
    repeats until the sequence ends (the final window may be cut short). Causal windows keep
    only their lower triangle, diagonal included.
    """
    num_blocks = head.shape[0]
    start = 0
    for i in range(num_blocks):  # never more windows than blocks
        if start >= num_blocks:
            break
        size = window_sizes[min(i, len(window_sizes) - 1)]
        end = min(start + size, num_blocks)
        window = head[start:end, start:end]  # a view: set bits, never clear earlier ones
        ones = torch.ones_like(window)
        window.bitwise_or_(torch.tril(ones) if causal else ones)
        start += size


def set_fixed_global_blocks(
    head: torch.Tensor,
    num_local_blocks: int,
    num_global_blocks: int,
    pattern: int,
    causal: bool,
    horizontal: bool,
) -> None:
    """Give every local window ``num_global_blocks`` representative blocks that all rows see.

    ``pattern`` picks which blocks of a window represent it: pattern 0 uses the last
    ``num_global_blocks`` blocks of the window, pattern 1 the ones before those, and so on.
    A final window that is cut short keeps the same offset, clamped so the representatives
    stay inside the sequence. Representatives are seen by every row (causal: by the rows at
    or below them); ``horizontal`` also lets the representatives see every block.
    """
    num_blocks = head.shape[0]
    offset = num_local_blocks - (1 + pattern) * num_global_blocks
    full_end = num_blocks - num_blocks % num_local_blocks
    starts = list(range(offset, full_end, num_local_blocks))
    if full_end < num_blocks:
        starts.append(min(full_end + offset, num_blocks - num_global_blocks))
    for start in starts:
        end = start + num_global_blocks
        first_row = start if causal else 0
        head[first_row:, start:end] = 1
        if horizontal:
            head[start:end, :] = 1


def global_spans(
    num_blocks: int, starts: Sequence[int], ends: Sequence[int] | None
) -> list[tuple[int, int]]:
    """``[start, end)`` block ranges of the global blocks that fall inside the sequence.

    Without ``ends`` each start is one block; ends past the sequence are clamped; starts past
    it are dropped (a layout built for a long sequence keeps working for a short one).
    """
    if ends is None:
        return [(s, s + 1) for s in starts if s < num_blocks]
    return [(s, min(e, num_blocks)) for s, e in zip(starts, ends) if s < num_blocks]


def set_global_columns(
    head: torch.Tensor, spans: Sequence[tuple[int, int]], causal: bool, horizontal: bool
) -> None:
    """Every row attends to the span's blocks (causal: rows from the span down);
    ``horizontal`` also lets the span's rows attend to every block."""
    for start, end in spans:
        if horizontal:
            head[start:end, :] = 1
        first_row = start if causal else 0
        head[first_row:, start:end] = 1


def set_global_rows_and_columns(head: torch.Tensor, spans: Sequence[tuple[int, int]]) -> None:
    """The span's blocks attend to everything and everything attends to them."""
    for start, end in spans:
        head[start:end, :] = 1
        head[:, start:end] = 1


def set_sliding_window(head: torch.Tensor, num_window_blocks: int, causal: bool) -> None:
    """Row ``r`` attends to blocks ``r - w .. r + w`` with ``w = num_window_blocks // 2``
    (causal: ``r - w .. r``), clipped to the sequence."""
    num_blocks = head.shape[0]
    half = num_window_blocks // 2
    rows = torch.arange(num_blocks).unsqueeze(1)  # (num_blocks, 1)
    cols = torch.arange(num_blocks).unsqueeze(0)  # (1, num_blocks)
    distance = cols - rows  # (num_blocks, num_blocks)
    inside = (distance >= -half) & (distance <= (0 if causal else half))
    head[inside] = 1


def set_random_blocks(
    head: torch.Tensor, num_random_blocks: int, causal: bool, rng: Sampler
) -> None:
    """Row ``r`` attends to ``num_random_blocks`` distinct blocks drawn with ``rng.sample``
    from all blocks (causal: from blocks ``0..r``; fewer when the row has fewer)."""
    num_blocks = head.shape[0]
    for row in range(num_blocks):
        population = range(row + 1) if causal else range(num_blocks)
        cols = rng.sample(population, min(num_random_blocks, len(population)))
        head[row, cols] = 1


def check_fits(what: str, count: int, num_blocks: int) -> None:
    """A per-row block count must not exceed the number of blocks in a row."""
    if num_blocks < count:
        raise ValueError(
            f"{what}={count} does not fit a row of {num_blocks} blocks; use a longer sequence "
            f"(at least {count} blocks) or a smaller {what}."
        )


def layout_density(layout: torch.Tensor) -> float:
    """Fraction of blocks that are computed (1.0 is dense attention)."""
    return float(layout.count_nonzero()) / max(layout.numel(), 1)
