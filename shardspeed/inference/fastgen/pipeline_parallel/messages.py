"""What rank 0 and the stage workers tell each other over their pipes (plain data).

Rank 0 -> every worker, in launch order::

    ("connect", ConnectInfo)              after load: join the group, allocate the KV cache
    ("batch", ([SequenceChunk], [mode]))  run this micro-batch through the stage
    ("copy_block", (src, dst))            a forked sample copies a KV block
    ("timers", reset)                     reply with the stage's busy/idle timers
    ("stop", None)                        exit

Workers answer ``("loaded", StageInfo)``, ``("ready", None)``, ``("timers", StageTimes)``
and, on a failure, ``("error", traceback text)``. The last stage sends each micro-batch's
``("result", (tokens, logits))`` in launch order. Hidden states do not travel here: they
go stage to stage over the group's point-to-point send/recv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspeed.inference.fastgen.kv_cache import KVCacheSpec
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence

CONNECT, BATCH, COPY_BLOCK, TIMERS, STOP = "connect", "batch", "copy_block", "timers", "stop"
LOADED, READY, RESULT, ERROR = "loaded", "ready", "result", "error"

# How the last stage returns a sequence's logits rows: none (no rows), the argmax token
# (greedy rows without per-request processors), or the fp32 rows themselves (rank 0
# samples them: random sampling, penalties, logprobs, forks).
NO_ROWS, ARGMAX, LOGITS = 0, 1, 2

# (token_ids, start_position, slot_mapping, block_table, rope_base_len, needs_logits,
#  all_logits) of one sequence
SequenceChunk = tuple[list[int], int, list[int], list[int], int, bool, bool]


@dataclass(frozen=True)
class ConnectInfo:
    """Everything a worker needs, after loading, to run micro-batches in step with rank 0."""

    port: int  # rank 0's TCPStore
    kv_spec: KVCacheSpec  # this stage's KV cache shape (its layers only)
    num_blocks: int
    backend: str  # attention backend rank 0 selected


@dataclass(frozen=True)
class StageInfo:
    """What a worker reports once its stage is loaded."""

    layer_bytes: int  # its decoder layers' weights
    total_bytes: int  # every weight it holds
    hidden_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class StageTimes:
    """One stage's time since the last reset: busy, and the window it fell in."""

    busy_s: float  # the window less the time spent waiting for input
    window_s: float  # from the reset to the end of the last micro-batch after it
    num_batches: int
    # The part of busy_s that needs no previous stage's output (a later stage preparing a
    # micro-batch from its description before the hidden states arrive); 0 on stage 0.
    prep_s: float = 0.0

    @property
    def idle_fraction(self) -> float:
        """Fraction of the window the stage waited for input (0 when nothing ran)."""
        return 1.0 - self.busy_s / self.window_s if self.window_s > 0 else 0.0


def pack_batch(batch: ScheduledBatch) -> list[SequenceChunk]:
    """The parts of ``batch`` a stage's forward reads (no request objects)."""
    return [
        (
            s.token_ids,
            s.start_position,
            s.slot_mapping,
            s.block_table,
            s.rope_base_len,
            s.needs_logits,
            s.all_logits,
        )  # fmt: skip
        for s in batch.sequences
    ]


def unpack_batch(chunks: list[SequenceChunk]) -> ScheduledBatch:
    """A batch for :func:`~shardspeed.inference.fastgen.ragged.build_ragged_batch` on a worker."""
    sequences = [
        ScheduledSequence(
            request=None,  # type: ignore[arg-type]  # the forward never reads it
            token_ids=token_ids,
            start_position=start,
            slot_mapping=slots,
            block_table=table,
            needs_logits=needs_logits,
            all_logits=all_logits,
            rope_base_len=rope_base_len,
        )
        for token_ids, start, slots, table, rope_base_len, needs_logits, all_logits in chunks
    ]
    return ScheduledBatch(sequences=sequences)
