"""Blocked attention over a ragged batch equals dense causal attention per sequence."""

from __future__ import annotations

import pytest
import torch

from shardspeed.inference.fastgen.attention import paged_attention
from shardspeed.inference.fastgen.block_pool import BlockPool
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.ragged import build_ragged_batch, group_decodes
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.scheduler import Scheduler


def _dense(q, k, v):
    """Reference causal attention of one full sequence; q [L, H, D], k/v [L, H_kv, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, -torch.inf).softmax(-1), v)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mixed_chunks_and_decodes_match_dense_attention(backend: str):
    _check_mixed_batches(backend)


@pytest.mark.parametrize("native_chunk_max", [0, 4, 16])
def test_cpu_backend_short_chunks_as_decode_rows(monkeypatch, native_chunk_max: int):
    """The "cpu" backend attends chunks of up to NATIVE_CHUNK_MAX_TOKENS tokens as one kernel
    row per token (causal by each row's context length); longer chunks keep SDPA."""
    from shardspeed.inference.fastgen import ragged

    monkeypatch.setattr(ragged, "NATIVE_CHUNK_MAX_TOKENS", native_chunk_max)
    native_chunks, sdpa_chunks = _check_mixed_batches("cpu")
    assert (native_chunks > 0) == (native_chunk_max > 1)
    assert (sdpa_chunks > 0) == (native_chunk_max < 7)  # chunks have up to 7 tokens here


def _check_mixed_batches(backend: str) -> tuple[int, int]:
    """Chunked prompts and decodes of 5 sequences through the scheduler, each step's output
    rows against dense attention; returns how many chunks (of > 1 token) were attended as
    decode rows and how many through SDPA."""
    torch.manual_seed(0)
    H, H_KV, D, BS, EXTRA = 4, 2, 8, 4, 3
    prompt_lens = [11, 3, 17, 6, 9]
    total = [n + EXTRA for n in prompt_lens]  # tokens whose K/V get computed
    qs = [torch.randn(n, H, D) for n in total]
    ks = [torch.randn(n, H_KV, D) for n in total]
    vs = [torch.randn(n, H_KV, D) for n in total]
    sched = Scheduler(BlockPool(32, BS), max_ragged_batch_size=7, max_ragged_sequence_count=4)
    reqs = [Request(str(i), [0] * n, SamplingParams()) for i, n in enumerate(prompt_lens)]
    for r in reqs:
        sched.add(r)
    cache = KVCache(KVCacheSpec(1, H_KV, D, BS, torch.float32), 32, torch.device("cpu"))
    got = [torch.zeros(n, H, D) for n in total]
    steps = native_chunks = sdpa_chunks = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        ragged = build_ragged_batch(batch, BS, torch.device("cpu"), backend)
        rows = [
            (int(s.request.request_id), p)
            for s in batch.sequences
            for p in range(s.start_position, s.context_len)
        ]
        q = torch.stack([qs[i][p] for i, p in rows])  # [N, H, D]
        k = torch.stack([ks[i][p] for i, p in rows])  # [N, H_kv, D]
        v = torch.stack([vs[i][p] for i, p in rows])
        out = paged_attention(q, k, v, cache, 0, ragged.slot_mapping, ragged.attn)
        multi = sum(s.num_tokens > 1 for s in batch.sequences)
        sdpa_chunks += len(ragged.attn.chunks)
        native_chunks += multi - len(ragged.attn.chunks)
        for row, (i, p) in enumerate(rows):
            got[i][p] = out[row]
        sched.commit(batch)
        for s in batch.sequences:
            if s.needs_logits:  # "sample" a token; stop once EXTRA decodes were computed
                if s.request.num_computed_tokens == total[int(s.request.request_id)]:
                    sched.finish(s.request, "length")
                else:
                    s.request.append_token(0, 0.0)
        steps += 1
    assert steps > 6  # prompts were chunked and decodes mixed in
    for i in range(len(total)):
        torch.testing.assert_close(got[i], _dense(qs[i], ks[i], vs[i]), atol=1e-5, rtol=1e-5)
    return native_chunks, sdpa_chunks


def test_group_decodes_bounds_padding():
    groups = group_decodes([100, 10, 12, 105, 300, 11])
    assert groups == [[1, 5, 2], [0, 3], [4]]
    assert group_decodes([]) == []
