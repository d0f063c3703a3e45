"""What rank 0 tells the workers, as plain picklable data.

One message per engine event, sent over each worker's pipe (ordered)::

    ("connect", ConnectInfo)        after load: join the group, allocate the KV cache
    ("batch", [SequenceChunk, ...])  run one ragged forward (no logits needed)
    ("copy_block", (src, dst))       a forked sample copies a KV block
    ("stop", None)                   exit

and the worker answers ``("loaded", None)``, ``("ready", None)`` or, on a failure,
``("error", traceback text)`` before it exits.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspeed.inference.fastgen.kv_cache import KVCacheSpec
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence

CONNECT, BATCH, COPY_BLOCK, STOP = "connect", "batch", "copy_block", "stop"
LOADED, READY, ERROR = "loaded", "ready", "error"

# (token_ids, start_position, slot_mapping, block_table, rope_base_len) of one sequence
SequenceChunk = tuple[list[int], int, list[int], list[int], int]


@dataclass(frozen=True)
class ConnectInfo:
    """Everything a worker needs, after loading, to run forwards in step with rank 0."""

    port: int  # rank 0's TCPStore
    kv_spec: KVCacheSpec  # this rank's KV cache shape (local KV heads)
    num_blocks: int
    backend: str  # attention backend rank 0 selected


def pack_batch(batch: ScheduledBatch) -> list[SequenceChunk]:
    """The parts of ``batch`` a worker's forward reads (no requests, no logits rows)."""
    return [
        (s.token_ids, s.start_position, s.slot_mapping, s.block_table, s.rope_base_len)
        for s in batch.sequences
    ]


def unpack_batch(chunks: list[SequenceChunk]) -> ScheduledBatch:
    """A batch for :func:`~shardspeed.inference.fastgen.ragged.build_ragged_batch` on a worker.

    No sequence asks for logits: a worker's LM head runs on zero rows.
    """
    sequences = [
        ScheduledSequence(
            request=None,  # type: ignore[arg-type]  # the forward never reads it
            token_ids=token_ids,
            start_position=start,
            slot_mapping=slots,
            block_table=table,
            needs_logits=False,
            rope_base_len=rope_base_len,
        )
        for token_ids, start, slots, table, rope_base_len in chunks
    ]
    return ScheduledBatch(sequences=sequences)
