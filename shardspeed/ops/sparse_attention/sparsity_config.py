"""Sparsity configs: which key blocks each query block attends to, with DeepSpeed's names.

Every class takes DeepSpeed's constructor arguments (same names, order and defaults) and its
``make_layout(seq_len)`` returns the same ``(num_heads, num_blocks, num_blocks)`` int64 layout
that ``deepspeed.ops.sparse_attention`` (<= 0.19.6) built, so a model trained with DeepSpeed's
sparse attention sees the same blocks here. The layout math lives in ``layout_math.py``; the
classes only validate arguments and pick which pieces to combine.

Random blocks (Variable, BigBird) are drawn with Python's ``random`` module, row by row, in
DeepSpeed's order, so after ``random.seed(s)`` both libraries draw the same layout. Pass
``seed=`` to draw from a private generator instead and leave the global one alone.

Per-head methods (``set_local_layout(h, layout)`` ...) keep DeepSpeed's names so subclasses
written against DeepSpeed still work.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from shardspeed.ops.sparse_attention import layout_math as lm


class SparsityConfig:
    """Base class: block size, head count and whether heads share one layout.

    Subclasses implement ``make_layout(seq_len)``. When ``different_layout_per_head`` is
    False only head 0 is built and then copied to every head.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}.")
        if block < 1:
            raise ValueError(f"block must be >= 1 (tokens per block), got {block}.")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout ``(num_heads, num_blocks, num_blocks)`` for ``seq_len`` tokens."""
        num_blocks = lm.num_blocks_for(seq_len, self.block)
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0 to every head unless each head has its own layout."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} has no layout; use one of DenseSparsityConfig, "
            "FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig, "
            "BSLongformerSparsityConfig, LocalSlidingWindowSparsityConfig, or subclass "
            "SparsityConfig and implement make_layout."
        )

    def _build(self, seq_len: int, fill_head) -> torch.Tensor:
        """Run ``fill_head(h, layout)`` for each head that has its own layout, then propagate."""
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            fill_head(h, layout)
        return self.check_and_propagate_first_head_layout(layout)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _rng(seed: int | None) -> lm.Sampler:
    """A private generator for ``seed``, or the ``random`` module itself (DeepSpeed's)."""
    return random.Random(seed) if seed is not None else random


def _check_global_indices(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if any(s < 0 for s in starts):
        raise ValueError(f"global_block_indices must be >= 0, got {list(starts)}.")
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_indices has {len(starts)} entries but global_block_end_indices has "
            f"{len(ends)}; give one end (exclusive) per start."
        )
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(
                f"global block start {start} must be smaller than its end {end} "
                "(global_block_end_indices are exclusive)."
            )


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block: dense attention, for comparison."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout.fill_(1)
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Local windows plus per-window global blocks (Child et al. 2019, "fixed" pattern)."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        causal = lm.is_causal(attention)
        if num_local_blocks < 1 or num_global_blocks < 1:
            raise ValueError(
                f"num_local_blocks ({num_local_blocks}) and num_global_blocks "
                f"({num_global_blocks}) must be >= 1."
            )
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"num_local_blocks={num_local_blocks} must be a multiple of "
                f"num_global_blocks={num_global_blocks}."
            )
        if causal and horizontal_global_attention:
            raise ValueError(
                "horizontal_global_attention=True needs attention='bidirectional' (a causal "
                "global block cannot attend to later blocks)."
            )
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} needs "
                "different_layout_per_head=True (with one shared layout there is one pattern)."
            )
        max_patterns = num_local_blocks // num_global_blocks
        if num_different_global_patterns > max_patterns:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} exceeds "
                f"num_local_blocks // num_global_blocks = {num_local_blocks} // "
                f"{num_global_blocks} = {max_patterns}."
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        causal = self.attention == "unidirectional"
        lm.set_local_windows(layout[h], [self.num_local_blocks], causal)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        lm.set_fixed_global_blocks(
            layout[h],
            self.num_local_blocks,
            self.num_global_blocks,
            pattern=h % self.num_different_global_patterns,
            causal=self.attention == "unidirectional",
            horizontal=self.horizontal_global_attention,
        )
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        def fill(h: int, layout: torch.Tensor) -> None:
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)

        return self._build(seq_len, fill)


class VariableSparsityConfig(SparsityConfig):
    """Fixed, generalised: random blocks, a list of window sizes, explicit global blocks."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        *,
        seed: int | None = None,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        causal = lm.is_causal(attention)
        if num_random_blocks < 0:
            raise ValueError(f"num_random_blocks must be >= 0, got {num_random_blocks}.")
        if not local_window_blocks or any(w < 1 for w in local_window_blocks):
            raise ValueError(
                f"local_window_blocks must be a non-empty list of sizes >= 1, got "
                f"{list(local_window_blocks)}."
            )
        _check_global_indices(global_block_indices, global_block_end_indices)
        if causal and horizontal_global_attention:
            raise ValueError(
                "horizontal_global_attention=True needs attention='bidirectional' (a causal "
                "global block cannot attend to later blocks)."
            )
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: lm.Sampler | None = None):
        # As in DeepSpeed, Variable draws from every block even when attention is causal.
        lm.check_fits("num_random_blocks", self.num_random_blocks, layout.shape[1])
        lm.set_random_blocks(layout[h], self.num_random_blocks, False, rng or _rng(self.seed))
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        causal = self.attention == "unidirectional"
        lm.set_local_windows(layout[h], self.local_window_blocks, causal)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        spans = lm.global_spans(
            layout.shape[1], self.global_block_indices, self.global_block_end_indices
        )
        lm.set_global_columns(
            layout[h],
            spans,
            causal=self.attention == "unidirectional",
            horizontal=self.horizontal_global_attention,
        )
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        rng = _rng(self.seed)

        def fill(h: int, layout: torch.Tensor) -> None:
            self.set_random_layout(h, layout, rng)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)

        return self._build(seq_len, fill)


class BigBirdSparsityConfig(SparsityConfig):
    """Random blocks + sliding window + leading global blocks (Zaheer et al. 2020)."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        *,
        seed: int | None = None,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        lm.is_causal(attention)
        for name, value in (
            ("num_random_blocks", num_random_blocks),
            ("num_sliding_window_blocks", num_sliding_window_blocks),
            ("num_global_blocks", num_global_blocks),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: lm.Sampler | None = None):
        lm.check_fits("num_random_blocks", self.num_random_blocks, layout.shape[1])
        causal = self.attention == "unidirectional"
        lm.set_random_blocks(layout[h], self.num_random_blocks, causal, rng or _rng(self.seed))
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        lm.check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        lm.set_sliding_window(layout[h], self.num_sliding_window_blocks, causal=False)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        """Internal-transformer-construction globals: the first blocks see and are seen by all."""
        lm.check_fits("num_global_blocks", self.num_global_blocks, layout.shape[1])
        lm.set_global_rows_and_columns(layout[h], [(0, self.num_global_blocks)])
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        rng = _rng(self.seed)

        def fill(h: int, layout: torch.Tensor) -> None:
            self.set_random_layout(h, layout, rng)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)

        return self._build(seq_len, fill)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020): sliding window + global blocks."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        lm.is_causal(attention)
        _check_global_indices(global_block_indices, global_block_end_indices)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        lm.check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        lm.set_sliding_window(layout[h], self.num_sliding_window_blocks, causal=False)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        spans = lm.global_spans(
            layout.shape[1], self.global_block_indices, self.global_block_end_indices
        )
        lm.set_global_rows_and_columns(layout[h], spans)
        if self.attention == "unidirectional":
            layout[h] = torch.tril(layout[h])
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        def fill(h: int, layout: torch.Tensor) -> None:
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)

        return self._build(seq_len, fill)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window (causal by default); all heads share it."""

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        num_sliding_window_blocks: int = 3,
        attention: str = "unidirectional",
    ):
        super().__init__(num_heads, block)
        lm.is_causal(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        lm.check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, layout.shape[1])
        causal = self.attention == "unidirectional"
        lm.set_sliding_window(layout[h], self.num_sliding_window_blocks, causal)
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        return self._build(seq_len, self.set_sliding_window_layout)
