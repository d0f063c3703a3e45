"""Device tensors for one ragged forward, built from a :class:`ScheduledBatch`.

All scheduled tokens of all sequences are concatenated into ``[N]`` vectors with
no padding: ``input_ids``, ``positions`` (``start_position + arange(n)`` per
sequence) and ``slot_mapping``. ``logits_indices`` are the rows whose logits are
needed (the last token of every sequence whose chunk reaches its final token).
``rope_lens`` is the sequence length each token's length-dependent RoPE (dynamic,
longrope) is computed for: ``max(rope_base_len, position + 1)``, what HF's
``generate`` uses whatever the chunking (see ``Request.rope_base_len``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardspeed.inference.fastgen.attention import (
    AttentionMetadata,
    ChunkMeta,
    DecodeBatch,
    DecodeGroup,
)
from shardspeed.inference.fastgen.scheduler import ScheduledBatch


@dataclass
class RaggedBatch:
    """Flattened inputs of one step (``N`` tokens, ``S`` sequences, ``M`` logits rows)."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_mapping: torch.Tensor  # [N] long
    logits_indices: torch.Tensor  # [M] long
    attn: AttentionMetadata
    rope_lens: torch.Tensor | None = None  # [N] long, see the module docstring

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def build_ragged_batch(
    batch: ScheduledBatch, block_size: int, device: torch.device, backend: str
) -> RaggedBatch:
    """Flatten ``batch`` and precompute the attention metadata every layer reuses."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    rope_bases: list[int] = []
    for seq in batch.sequences:
        input_ids.extend(seq.token_ids)
        positions.extend(range(seq.start_position, seq.context_len))
        rope_bases.extend([seq.rope_base_len] * seq.num_tokens)
        slots.extend(seq.slot_mapping)
        if seq.all_logits:  # every token's logits (prompt logprobs)
            logits_indices.extend(range(len(input_ids) - seq.num_tokens, len(input_ids)))
        elif seq.needs_logits:
            logits_indices.append(len(input_ids) - 1)

    if backend == "flash":
        attn = _flash_metadata(batch, device)
    else:
        attn = _torch_metadata(batch, block_size, device, native_decodes=backend == "cpu")

    def as_long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    positions_t = as_long(positions)
    return RaggedBatch(
        input_ids=as_long(input_ids),
        positions=positions_t,
        slot_mapping=as_long(slots),
        logits_indices=as_long(logits_indices),
        attn=attn,
        rope_lens=torch.maximum(positions_t + 1, as_long(rope_bases)),
    )


def group_decodes(context_lens: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices of single-token sequences grouped so padding stays under ``max_padding``.

    Sorted by context length; a group grows while its longest context is at most
    ``(1 + max_padding)`` times its shortest. Batched SDPA beats a per-sequence loop
    on similar lengths, and loses when padding dominates (measured in docs/inference.md).
    """
    order = sorted(range(len(context_lens)), key=lambda i: context_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and context_lens[i] <= (1 + max_padding) * context_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# The ``"cpu"`` backend attends chunks of up to this many tokens as decode rows (below).
NATIVE_CHUNK_MAX_TOKENS = 6


def _torch_metadata(
    batch: ScheduledBatch, block_size: int, device: torch.device, native_decodes: bool = False
) -> AttentionMetadata:
    """Prompt chunks, and decodes either grouped for padded SDPA or (``native_decodes``, the
    ``"cpu"`` backend) all in one :class:`DecodeBatch`.

    With ``native_decodes`` a chunk of at most :data:`NATIVE_CHUNK_MAX_TOKENS` tokens (a
    speculative verify of ``[last, d1..dk]``, a draft's catch-up, a short prompt tail) joins
    the kernel call as one decode row per token: token ``i`` of a chunk ending at context
    ``ctx`` is a query over the first ``ctx - n + 1 + i`` keys, which is causal attention,
    and saves the per-chunk gather and SDPA call (measured in docs/inference.md)."""
    meta = AttentionMetadata(backend="cpu" if native_decodes else "torch")
    decodes: list[tuple[int, int, list[int]]] = []  # (row, context_len, block_table)
    row = 0
    for seq in batch.sequences:
        n, ctx = seq.num_tokens, seq.context_len
        table = seq.block_table[: -(-ctx // block_size)]
        if n == 1:
            decodes.append((row, ctx, table))
        elif native_decodes and n <= NATIVE_CHUNK_MAX_TOKENS:
            decodes.extend((row + i, ctx - n + 1 + i, table) for i in range(n))
        else:
            mask = None
            if seq.start_position > 0:
                q_pos = torch.arange(seq.start_position, ctx).unsqueeze(1)  # [n, 1]
                mask = (torch.arange(ctx).unsqueeze(0) <= q_pos).to(device)  # [n, ctx]
            blocks = torch.tensor(table, dtype=torch.long).to(device)
            meta.chunks.append(ChunkMeta(row, n, ctx, blocks, mask))
        row += n
    if native_decodes:
        if decodes:
            meta.decodes = _decode_batch(decodes, row, device)
        return meta
    for members in group_decodes([ctx for _, ctx, _ in decodes]):
        lens = torch.tensor([decodes[i][1] for i in members])
        max_blocks = max(len(decodes[i][2]) for i in members)
        table = torch.zeros(len(members), max_blocks, dtype=torch.long)  # [G, MB]
        for j, i in enumerate(members):
            table[j, : len(decodes[i][2])] = torch.tensor(decodes[i][2])
        padded_len = max_blocks * block_size
        mask = None
        if bool((lens < padded_len).any()):
            keep = torch.arange(padded_len).unsqueeze(0) < lens.unsqueeze(1)  # [G, MB * BS]
            mask = keep[:, None, None, :].to(device)  # [G, 1, 1, MB * BS]
        rows = torch.tensor([decodes[i][0] for i in members], dtype=torch.long)
        meta.decode_groups.append(DecodeGroup(rows.to(device), table.to(device), mask))
    return meta


def _decode_batch(
    decodes: list[tuple[int, int, list[int]]], num_rows: int, device: torch.device
) -> DecodeBatch:
    """All decodes ``(row, context_len, block_table)`` as one kernel call's inputs."""
    max_blocks = max(len(table) for _, _, table in decodes)
    flat: list[int] = []  # one tensor from one list: per-row tensors cost ~1 ms per step
    for _, _, blocks in decodes:
        flat.extend(blocks)
        flat.extend([0] * (max_blocks - len(blocks)))
    table = torch.tensor(flat, dtype=torch.long).view(len(decodes), max_blocks)  # [S, MB]
    rows = [r for r, _, _ in decodes]
    return DecodeBatch(
        rows=torch.tensor(rows, dtype=torch.long).to(device),
        block_table=table.to(device),
        context_lens=torch.tensor([ctx for _, ctx, _ in decodes], dtype=torch.long).to(device),
        all_rows=len(rows) == num_rows,
    )


def _flash_metadata(batch: ScheduledBatch, device: torch.device) -> AttentionMetadata:
    q_lens = [s.num_tokens for s in batch.sequences]
    k_lens = [s.context_len for s in batch.sequences]
    max_blocks = max(len(s.block_table) for s in batch.sequences)
    table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)  # [S, max_blocks]
    for i, s in enumerate(batch.sequences):
        table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)

    def cumulative(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    return AttentionMetadata(
        backend="flash",
        cu_seqlens_q=cumulative(q_lens),
        cu_seqlens_k=cumulative(k_lens),
        block_table=table.to(device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
    )
