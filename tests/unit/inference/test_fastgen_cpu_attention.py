"""FastGen's native CPU decode-attention kernel against dense attention, and the engine's
tokens with it against the torch backend."""

from __future__ import annotations

import pytest
import torch

from shardspeed.inference.fastgen.attention import select_backend
from shardspeed.inference.fastgen.cpu_attention import kernel_available, paged_decode


def _reference(q, k_cache, v_cache, table, lens, scale, window, softcap):
    """Per sequence: fp64 softmax attention of its one query over its first ``lens`` keys."""
    out = []
    num_kv, d = k_cache.shape[2], k_cache.shape[3]
    rep = q.shape[1] // num_kv
    for g in range(q.shape[0]):
        n = int(lens[g])
        k = k_cache[table[g]].reshape(-1, num_kv, d)[:n].double().repeat_interleave(rep, 1)
        v = v_cache[table[g]].reshape(-1, num_kv, d)[:n].double().repeat_interleave(rep, 1)
        s = torch.einsum("hd,lhd->hl", q[g].double(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if window:
            s[:, : max(0, n - window)] = -torch.inf
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]
)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 48), (4, 4, 64), (6, 1, 80)])
@pytest.mark.parametrize(
    ("block", "context_lens"),
    [
        (16, [1, 16, 17, 45, 100]),
        (8, [3, 9, 60, 31]),  # tiles cut by blocks smaller than a tile
        (32, [33, 70, 600, 513, 512]),  # over 512 keys: the per-key loop beside the tiles
    ],
)
def test_kernel_matches_dense_attention(
    dtype, tol, heads, kv_heads, head_dim, block, context_lens
) -> None:
    assert kernel_available()
    torch.manual_seed(0)
    lens = torch.tensor(context_lens)
    per_seq = -(-max(context_lens) // block)
    num_blocks = per_seq + 8
    k = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    v = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    table = torch.stack([torch.randperm(num_blocks)[:per_seq] for _ in lens])  # any order
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    for window, softcap in [(None, None), (10, None), (None, 20.0), (33, 5.0)]:
        got = paged_decode(q, k, v, table, lens, scale=scale, window=window, softcap=softcap)
        want = _reference(q, k, v, table, lens, scale, window, softcap)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_sequence_gets_the_same_output_alone_and_in_a_batch(dtype) -> None:
    """Many sequences: a work item takes every KV head and its tiles are converted in one
    run; one sequence: items are single heads, rows converted one by one. Same sums."""
    torch.manual_seed(1)
    block, heads, kv_heads, head_dim = 16, 8, 2, 48
    lens = torch.tensor([5, 16, 17, 40, 200, 380, 1, 511])
    per_seq = -(-int(lens.max()) // block)
    num_blocks = per_seq * len(lens)
    k = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    v = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    table = torch.randperm(num_blocks).view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    batch = paged_decode(q, k, v, table, lens, scale=head_dim**-0.5)
    for g in range(len(lens)):
        alone = paged_decode(q[g : g + 1], k, v, table[g : g + 1], lens[g : g + 1],
                             scale=head_dim**-0.5)  # fmt: skip
        assert torch.equal(alone, batch[g : g + 1]), g


def test_kernel_refuses_bad_inputs() -> None:
    q = torch.randn(2, 4, 8)
    cache = torch.randn(4, 4, 2, 8)
    table = torch.zeros(2, 1, dtype=torch.long)
    lens = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="one dtype"):
        paged_decode(q, cache.bfloat16(), cache.bfloat16(), table, lens, scale=1.0)
    with pytest.raises(RuntimeError, match="int64"):
        paged_decode(q, cache, cache, table.int(), lens, scale=1.0)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        paged_decode(torch.randn(2, 3, 8), cache, cache, table, lens, scale=1.0)


def test_select_backend_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, 16, torch.float32) == "cpu"
    assert select_backend("torch", cpu, 16, torch.float32) == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on CPU"):
        select_backend("cpu", torch.device("meta"), 16, torch.float32)


def test_engine_tokens_equal_with_the_torch_backend(tiny_llama) -> None:
    """Greedy tokens of a mixed prefill/decode run: native kernel == torch backend (fp32)."""
    from shardspeed.inference.fastgen.engine import InferenceEngine
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    prompts = [[5 + i, 9, 13 + 2 * i, 7] * (3 + i) for i in range(6)]
    outs = {}
    for backend in ("torch", "cpu"):
        engine = InferenceEngine.from_pretrained(
            tiny_llama, dtype=torch.float32, attention_backend=backend, block_size=4,
            max_ragged_batch_size=24,
        )  # fmt: skip
        assert engine.runner.backend == backend
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        outs[backend] = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert outs["cpu"] == outs["torch"]
