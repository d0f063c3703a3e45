"""Fixed-size KV blocks: free list, reference counts and an optional prefix cache.

Pure CPU bookkeeping: a block is an integer id in ``[0, num_blocks)``; the tensors
live in :mod:`kv_cache`. A block is *used* while its reference count is > 0.
Blocks with count 0 sit in one free queue ordered least-recently-freed first.

With ``enable_prefix_caching`` every *full* block can be registered under a hash
chain, from the step that fills it on (so requests admitted later in that step
share it; see ``Scheduler._grant``), ``h_i = sha256(h_{i-1} || tokens_of_block_i)``. A
freed block keeps its hash while it waits in the free queue, so a later request
with the same prefix can take it back (``touch``) instead of recomputing it;
allocation evicts the least recently freed block first (LRU).

A sequence's block table may hold :data:`PLACEHOLDER_BLOCK` where a block was freed
because no query can read it again (sliding-window attention, see
``Scheduler._release_window``); :meth:`free` and :meth:`fork` skip placeholders.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

PLACEHOLDER_BLOCK = -1  # block-table entry of a block freed outside the attention window


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block, chained to the hash of the block before it."""
    h = hashlib.sha256(parent_hash or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    """Allocator for ``num_blocks`` blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(
                f"num_blocks={num_blocks} must be >= 1; give the KV cache more memory."
            )
        if block_size < 1:
            raise ValueError(
                f"block_size={block_size} must be >= 1 (typical: 16 on CPU, 64 on CUDA)."
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently freed first (value unused).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self.num_cache_hits = 0  # blocks taken back from the prefix cache

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (cached-but-unused blocks included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------- alloc / free
    def allocate(self, num: int) -> list[int]:
        """Take ``num`` free blocks (reference count 1), evicting cached ones LRU."""
        if num > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {num} KV blocks but only {len(self._free)} are free"
            )
        blocks = []
        for _ in range(num):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free queue.

        Blocks are queued in reverse order so that, under prefix caching, a
        sequence's last (least shareable) block is evicted before its first.
        Placeholders (:data:`PLACEHOLDER_BLOCK`) are skipped.
        """
        blocks = [b for b in blocks if b != PLACEHOLDER_BLOCK]
        for block in blocks:
            if not 0 <= block < self.num_blocks or self.ref_counts[block] <= 0:
                raise AssertionError(f"double free or bad block id {block}")
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if not self.enable_prefix_caching:
                    self._evict(block)
                self._free[block] = None

    def fork(self, blocks: Sequence[int]) -> list[int]:
        """Share ``blocks`` with another sequence (reference count + 1 each).

        Only full blocks may be shared: a block that will still be written to
        must not be forked (there is no copy-on-write). Placeholders are kept as
        placeholders.
        """
        for block in blocks:
            if block == PLACEHOLDER_BLOCK:
                continue
            if self.ref_counts[block] <= 0:
                raise AssertionError(f"cannot fork free block {block}")
            self.ref_counts[block] += 1
        return list(blocks)

    # ---------------------------------------------------------- prefix cache
    def lookup(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Cached block ids for the longest run of leading hashes (no side effects)."""
        hits = []
        for h in block_hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block registered under ``block_hash`` (used or free), or None."""
        return self._hash_to_block.get(block_hash)

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are currently in the free queue (touching them costs free blocks)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks found by :meth:`lookup` (placeholders skipped)."""
        blocks = [b for b in blocks if b != PLACEHOLDER_BLOCK]
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        self.num_cache_hits += len(blocks)

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that ``block`` holds the full block whose chained hash is ``block_hash``."""
        if (
            not self.enable_prefix_caching
            or block == PLACEHOLDER_BLOCK
            or block_hash in self._hash_to_block
        ):
            return
        if block in self._block_to_hash:  # already registered under its (only possible) hash
            return
        self._hash_to_block[block_hash] = block
        self._block_to_hash[block] = block_hash

    def forget(self, block: int) -> None:
        """Drop ``block``'s prefix hash (its contents will not match it)."""
        self._evict(block)

    def _evict(self, block: int) -> None:
        h = self._block_to_hash.pop(block, None)
        if h is not None:
            del self._hash_to_block[h]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently carry a prefix hash (used or free)."""
        return len(self._block_to_hash)
