"""KV slots for speculative tokens: reserve them before a step, roll them back after.

A decode step of a request with ``n`` tokens (the last one, at position ``n - 1``, not
yet in the KV) that proposes ``k`` tokens writes K/V at positions ``n - 1 .. n + k - 1``:
its block table must cover ``n + k`` slots, where the scheduler allocated ``n``. After
verification ``a <= k`` proposals are kept: the request's ``num_computed_tokens``
becomes ``n + a`` and it holds ``n + a + 1`` tokens (the accepted ones plus one
corrected or bonus token); the blocks past ``ceil((n + a) / block_size)`` go back to the
pool, leaving the table as a step without speculation would (the scheduler allocates the
next token's slot when it schedules it). Slots of rejected tokens inside a kept block are simply overwritten later
(attention never reads past a sequence's ``context_len``).

Pure bookkeeping on :class:`~..block_pool.BlockPool` block ids; no tensors.
"""

from __future__ import annotations

from shardspeed.inference.fastgen.block_pool import PLACEHOLDER_BLOCK, BlockPool
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.scheduler import ScheduledSequence


def reserve_slots(pool: BlockPool, req: Request, num_tokens: int) -> int:
    """Grow ``req``'s block table towards ``num_tokens`` slots with the blocks that are free;
    return how many slots it covers now (at most ``num_tokens``)."""
    held = len(req.block_table)
    need = pool.blocks_for_tokens(num_tokens) - held
    take = min(max(need, 0), pool.num_free)
    if take:
        req.block_table.extend(pool.allocate(take))
    return min(num_tokens, len(req.block_table) * pool.block_size)


def trim_blocks(pool: BlockPool, req: Request, num_tokens: int) -> int:
    """Free ``req``'s blocks past the first ``ceil(num_tokens / block_size)``; return how
    many were freed."""
    keep = pool.blocks_for_tokens(num_tokens)
    extra = req.block_table[keep:]
    if extra:
        pool.free(extra)
        del req.block_table[keep:]
    return len(extra)


def live_table(seq: ScheduledSequence, req: Request) -> list[int]:
    """The scheduled sequence's block table (placeholders already replaced) extended with
    the lookahead blocks reserved after scheduling."""
    table = list(seq.block_table)
    table.extend(req.block_table[len(table) :])
    return table


def sequence(
    req: Request,
    token_ids: list[int],
    start: int,
    block_table: list[int],
    block_size: int,
    all_logits: bool = False,
) -> ScheduledSequence:
    """A :class:`ScheduledSequence` computing ``token_ids`` at positions ``start ..``:
    logits of its last token, or of every token with ``all_logits``."""
    end = start + len(token_ids)
    slots = [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    assert all(block_table[p // block_size] != PLACEHOLDER_BLOCK for p in range(start, end))
    return ScheduledSequence(
        request=req,
        token_ids=list(token_ids),
        start_position=start,
        slot_mapping=slots,
        block_table=block_table,
        needs_logits=True,
        all_logits=all_logits,
        rope_base_len=req.rope_base_len,
    )
