"""DeepSpeed-Ulysses sequence parallelism: attention over a sequence sharded across ranks.

* :mod:`~.heads`: pure head-layout math (GQA groups, KV replication, uneven splits).
* :mod:`~.all_to_all`: the differentiable all-to-alls between sequence and head sharding.
* :mod:`~.layer`: ``DistributedAttention`` (DeepSpeed's ``deepspeed.sequence.layer`` API).
* :mod:`~.groups`: the sequence-axis process group, from one cached ``Topology`` per sp size.
* :mod:`~.batch`: how a sample is split over the group (contiguous chunks, global positions).
* :mod:`~.loss`: the full-sequence mean loss from sharded logits; cross-rank label shift.
* :mod:`~.hf`: ``make_hf_sequence_parallel`` for Hugging Face Llama-family models.

See docs/sequence_parallel.md.
"""

from __future__ import annotations

from shardspeed.parallel.sequence.all_to_all import heads_to_seq, seq_to_heads
from shardspeed.parallel.sequence.batch import local_position_ids, shard_sequence
from shardspeed.parallel.sequence.groups import register_topology, sequence_group, topology_for
from shardspeed.parallel.sequence.heads import HeadLayout, plan_heads
from shardspeed.parallel.sequence.hf import make_hf_sequence_parallel
from shardspeed.parallel.sequence.layer import DistributedAttention
from shardspeed.parallel.sequence.loss import (
    SequenceParallelCausalLMLoss,
    causal_lm_targets,
    sequence_parallel_cross_entropy,
)

__all__ = [
    "DistributedAttention",
    "HeadLayout",
    "SequenceParallelCausalLMLoss",
    "causal_lm_targets",
    "heads_to_seq",
    "local_position_ids",
    "make_hf_sequence_parallel",
    "plan_heads",
    "register_topology",
    "seq_to_heads",
    "sequence_group",
    "sequence_parallel_cross_entropy",
    "shard_sequence",
    "topology_for",
]
