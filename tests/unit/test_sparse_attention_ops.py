"""Block-sparse attention kernel and modules: parity with dense attention masked to the layout.

The reference is plain dense attention with the layout expanded to tokens; a query row with
no allowed key outputs zeros in both (the defined behaviour; dense softmax would give NaN).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardspeed.ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseAttentionUtils,
    SparseSelfAttention,
    VariableSparsityConfig,
    block_sparse_attention,
    build_plan,
)

TOL = dict(atol=1e-5, rtol=1e-5)
B, H, L, D, BLOCK = 2, 4, 64, 16, 8


def dense_reference(q, k, v, layout, rpe=None, kp_bias=None, attn_bias=None):
    """softmax(q k^T / sqrt(D) + biases, masked to the layout) @ v; empty rows give 0."""
    block = q.shape[2] // layout.shape[-1]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, L, L)
    if rpe is not None:
        s = s + rpe
    if kp_bias is not None:
        s = s + kp_bias[:, None, None, :]
    if attn_bias is not None:
        s = s + attn_bias
    allowed = layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()  # (H, L, L)
    s = s.masked_fill(~allowed, float("-inf"))
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(s - row_max)
    total = p.sum(-1, keepdim=True)
    p = p / torch.where(total == 0, torch.ones_like(total), total)
    return p @ v


def mul_to_bias(mask):
    return torch.zeros(mask.shape).masked_fill(mask == 0, float("-inf"))


def inputs(dtype=torch.float32, seed=0, batch=B, heads=H, seq=L):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, seq, D, generator=gen, dtype=dtype).requires_grad_()
        for _ in range(3)
    ]


CONFIGS = {
    "dense": DenseSparsityConfig(H, block=BLOCK),
    "fixed": FixedSparsityConfig(H, block=BLOCK, num_local_blocks=2),
    "fixed_causal_per_head": FixedSparsityConfig(
        H,
        block=BLOCK,
        different_layout_per_head=True,
        num_local_blocks=4,
        attention="unidirectional",
        num_different_global_patterns=4,
    ),
    "fixed_horizontal": FixedSparsityConfig(
        H, block=BLOCK, num_local_blocks=4, horizontal_global_attention=True
    ),
    "variable": VariableSparsityConfig(
        H, block=BLOCK, num_random_blocks=1, local_window_blocks=[1, 3], seed=3
    ),
    "bigbird": BigBirdSparsityConfig(
        H, block=BLOCK, different_layout_per_head=True, num_random_blocks=2, seed=1
    ),
    "bslongformer": BSLongformerSparsityConfig(H, block=BLOCK, global_block_indices=[0, 5]),
    "local_causal": LocalSlidingWindowSparsityConfig(H, block=BLOCK),
}


def check_parity(out, ref, tensors, grad_seed=1):
    torch.testing.assert_close(out, ref, **TOL)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    got = torch.autograd.grad(out, tensors, grad)
    want = torch.autograd.grad(ref, tensors, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_module_matches_dense_reference(name):
    attn = SparseSelfAttention(CONFIGS[name], max_seq_length=128)
    q, k, v = inputs()
    layout = attn.get_layout(L)
    check_parity(attn(q, k, v), dense_reference(q, k, v, layout), [q, k, v])


@pytest.mark.parametrize("name", ["fixed", "bigbird", "fixed_causal_per_head"])
@pytest.mark.parametrize("kp_mode,attn_mode", [("add", "mul"), ("mul", "add")])
def test_masks_and_rpe_match_dense_reference(name, kp_mode, attn_mode):
    attn = SparseSelfAttention(
        CONFIGS[name], key_padding_mask_mode=kp_mode, attn_mask_mode=attn_mode, max_seq_length=L
    )
    q, k, v = inputs(seed=2)
    gen = torch.Generator().manual_seed(3)
    rpe = torch.randn(B, H, L, L, generator=gen).requires_grad_()
    if kp_mode == "add":
        kp = torch.zeros(B, L)
        kp[1, 40:] = -10000.0  # BERT-style additive padding
        kp[0, 5] = 0.5
        kp_bias = kp
    else:
        kp = torch.ones(B, 1, 1, L)  # squeezes to (B, L)
        kp[1, ..., 37:] = 0
        kp_bias = mul_to_bias(kp.view(B, L))
    if attn_mode == "mul":
        am = (torch.rand(L, L, generator=gen) > 0.2).float()
        am_bias = mul_to_bias(am)
    else:
        am = torch.randn(L, L, generator=gen)
        am_bias = am
    out = attn(q, k, v, rpe=rpe, key_padding_mask=kp, attn_mask=am)
    ref = dense_reference(q, k, v, attn.get_layout(L), rpe, kp_bias, am_bias)
    check_parity(out, ref, [q, k, v, rpe])


def test_broadcast_biases_and_per_batch_attn_mask():
    layout = CONFIGS["bigbird"].make_layout(L)
    q, k, v = inputs(seed=4)
    rpe = torch.randn(1, H, L, L).requires_grad_()  # shared over the batch
    attn_bias = torch.randn(B, L, L)  # one mask per batch element
    out = block_sparse_attention(q, k, v, layout, rpe=rpe, attn_bias=attn_bias)
    ref = dense_reference(q, k, v, layout, rpe, None, attn_bias[:, None])
    check_parity(out, ref, [q, k, v, rpe])


def test_empty_rows_and_fully_masked_rows_give_zeros():
    layout = CONFIGS["fixed"].make_layout(L)
    layout[1, 3] = 0  # head 1, query block 3 attends to nothing
    layout[2, :, 2] = 0
    q, k, v = inputs(seed=5)
    kp_bias = torch.zeros(B, L)
    kp_bias[1] = float("-inf")  # every key of batch element 1 is padding
    out = block_sparse_attention(q, k, v, layout, key_padding_bias=kp_bias)
    assert torch.equal(out[:, 1, 3 * BLOCK : 4 * BLOCK], torch.zeros(B, BLOCK, D))
    assert torch.equal(out[1], torch.zeros(H, L, D))
    ref = dense_reference(q, k, v, layout, kp_bias=kp_bias)
    check_parity(out, ref, [q, k, v])
    out = block_sparse_attention(q, k, v, layout, key_padding_bias=kp_bias)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert torch.equal(grads[0][1], torch.zeros(H, L, D))  # no gradient through empty rows


def test_gradcheck_fp64():
    heads, seq, head_dim = 2, 12, 2
    config = BigBirdSparsityConfig(heads, block=4, different_layout_per_head=True, seed=0)
    plan = build_plan(config.make_layout(seq))
    gen = torch.Generator().manual_seed(6)
    q, k, v, rpe = (
        torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
        for shape in [(1, heads, seq, head_dim)] * 3 + [(1, 1, seq, seq)]  # rpe shared by heads
    )
    kp_bias = torch.zeros(1, seq, dtype=torch.float64)
    kp_bias[0, -3:] = float("-inf")

    def fn(q, k, v, rpe):
        return block_sparse_attention(q, k, v, plan, rpe=rpe, key_padding_bias=kp_bias)

    assert torch.autograd.gradcheck(fn, (q, k, v, rpe))


@pytest.mark.parametrize("chunk_elements", [1, 3000, 1 << 30])
def test_chunking_does_not_change_the_result(chunk_elements):
    layout = CONFIGS["variable"].make_layout(L)
    q, k, v = inputs(seed=7)
    out = block_sparse_attention(q, k, v, layout, chunk_elements=chunk_elements)
    ref = dense_reference(q, k, v, layout)
    check_parity(out, ref, [q, k, v])


def test_work_scales_with_nonzero_blocks():
    """Counted matmul FLOPs: 2 GEMMs forward, 5 backward, each over the nnz blocks only."""
    seq, heads = 512, 2
    config = FixedSparsityConfig(heads, block=16, num_local_blocks=4)
    plan = build_plan(config.make_layout(seq))
    assert plan.padded_blocks == plan.nnz_blocks  # Fixed rows all have the same length
    q, k, v = inputs(batch=1, heads=heads, seq=seq)
    with FlopCounterMode(display=False) as counter:
        block_sparse_attention(q, k, v, plan).sum().backward()
    per_gemm = 2 * plan.nnz_blocks * 16 * 16 * D
    assert counter.get_total_flops() == 7 * per_gemm
    dense_flops = 7 * 2 * heads * seq * seq * D
    assert counter.get_total_flops() / dense_flops == pytest.approx(plan.density)
    assert plan.density < 0.5


def test_bucket_padding_is_bounded_for_irregular_rows():
    plan = build_plan(CONFIGS["fixed_horizontal"].make_layout(256))  # global rows are full
    assert len(plan.buckets) > 1
    assert plan.padded_blocks <= plan.nnz_blocks / 0.75


def test_reduced_precision_runs_close_to_fp32():
    attn = SparseSelfAttention(CONFIGS["fixed"], max_seq_length=L)
    q, k, v = inputs(seed=8)
    ref = attn(q, k, v)
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out = attn(*low)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    assert low[0].grad.dtype == torch.bfloat16 and bool(torch.isfinite(low[0].grad).all())


def test_key_may_arrive_transposed():
    attn = SparseSelfAttention(CONFIGS["fixed"], max_seq_length=L)
    q, k, v = inputs(seed=9)
    torch.testing.assert_close(attn(q, k.transpose(2, 3), v), attn(q, k, v))


def test_shorter_sequences_use_the_master_layout_corner():
    config = FixedSparsityConfig(H, block=BLOCK, num_local_blocks=3)
    attn = SparseSelfAttention(config, max_seq_length=128)
    assert torch.equal(attn.get_layout(40), config.make_layout(128)[:, :5, :5])
    q, k, v = inputs(seed=10, seq=40)
    check_parity(attn(q, k, v), dense_reference(q, k, v, attn.get_layout(40)), [q, k, v])


def test_master_layout_is_a_buffer_and_loads():
    source = SparseSelfAttention(BigBirdSparsityConfig(H, block=BLOCK, seed=1), max_seq_length=L)
    target = SparseSelfAttention(BigBirdSparsityConfig(H, block=BLOCK, seed=2), max_seq_length=L)
    q, k, v = inputs(seed=11)
    before = target(q, k, v)  # caches a plan for the old layout
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.master_layout, source.master_layout)
    torch.testing.assert_close(target(q, k, v), source(q, k, v))
    assert not torch.allclose(before, target(q, k, v))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda a, q: a(q[:, :, :60], q[:, :, :60], q[:, :, :60]), "multiple of the block size"),
        (
            lambda a, q: a(q.repeat(1, 1, 3, 1), q.repeat(1, 1, 3, 1), q.repeat(1, 1, 3, 1)),
            "max_seq_length",
        ),
        (lambda a, q: a(q[:, :2], q[:, :2], q[:, :2]), "heads"),
        (lambda a, q: a(q, q, q[:, :, :32]), "self-attention"),
        (lambda a, q: a(q, q, q, key_padding_mask=torch.ones(B, L + 1)), "key_padding_mask"),
        (lambda a, q: a(q, q, q, attn_mask=torch.ones(L, L + 1)), "attn_mask"),
    ],
)
def test_errors_name_the_problem(call, match):
    attn = SparseSelfAttention(CONFIGS["fixed"], max_seq_length=128)
    q = torch.randn(B, H, L, D)
    with pytest.raises(ValueError, match=match):
        call(attn, q)


def test_bad_mask_mode_is_rejected():
    with pytest.raises(ValueError, match="key_padding_mask_mode"):
        SparseSelfAttention(CONFIGS["fixed"], key_padding_mask_mode="xor")


# ----------------------------------------------------------------------------- BERT


class TinyBertConfig:
    hidden_size = 32
    num_attention_heads = 4
    max_position_embeddings = 64


def test_bert_sparse_self_attention_with_extended_mask():
    torch.manual_seed(0)
    config = TinyBertConfig()
    layer = BertSparseSelfAttention(config, FixedSparsityConfig(4, block=BLOCK, num_local_blocks=2))
    hidden = torch.randn(B, L, config.hidden_size)
    pad = torch.zeros(B, 1, 1, L)
    pad[1, ..., 50:] = -10000.0  # BERT's extended additive mask
    out = layer(hidden, pad)
    assert out.shape == (B, L, config.hidden_size)
    split = lambda x: x.view(B, L, 4, 8).transpose(1, 2)  # noqa: E731
    q, k, v = split(layer.query(hidden)), split(layer.key(hidden)), split(layer.value(hidden))
    layout = layer.sparse_self_attention.get_layout(L)
    ref = dense_reference(q, k, v, layout, kp_bias=pad.view(B, L)).transpose(1, 2).reshape(B, L, -1)
    torch.testing.assert_close(out, ref, **TOL)
    assert layer.sparse_self_attention.master_layout.shape[-1] == 2048 // BLOCK


try:
    import transformers
except ImportError:  # pragma: no cover - the test extra installs it
    transformers = None
needs_transformers = pytest.mark.skipif(
    transformers is None, reason="transformers is not installed (pip install -e '.[test]')"
)


def tiny_bert(impl: str):
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation=impl,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


@needs_transformers
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_bert_replacement_with_dense_layout_matches_the_original(impl):
    dense = tiny_bert(impl)
    sparse = SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        copy.deepcopy(dense), 64, DenseSparsityConfig(num_heads=4, block=4)
    )
    assert (
        sparse.encoder.layer[0].attention.self.query
        is not dense.encoder.layer[0].attention.self.query
    )
    ids = torch.randint(1, 50, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0
    ref = dense(input_ids=ids, attention_mask=mask).last_hidden_state
    pad_len, ids_p, mask_p, types_p, _, _ = SparseAttentionUtils.pad_to_block_size(
        4, ids, mask, torch.zeros_like(ids), None, None, 0, None
    )
    assert pad_len == 3 and ids_p.shape == (2, 16) and mask_p[:, 13:].sum() == 0
    out = sparse(input_ids=ids_p, attention_mask=mask_p, token_type_ids=types_p).last_hidden_state
    out = SparseAttentionUtils.unpad_sequence_output(pad_len, out)
    torch.testing.assert_close(out[0], ref[0], **TOL)
    torch.testing.assert_close(out[1, :9], ref[1, :9], **TOL)


@needs_transformers
def test_hf_bert_replacement_with_fixed_layout_trains():
    model = SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        tiny_bert("eager").train(),
        64,
        FixedSparsityConfig(num_heads=4, block=4, num_local_blocks=2),
    )
    ids = torch.randint(1, 50, (2, 32))
    model(input_ids=ids).last_hidden_state.square().mean().backward()
    grad = model.encoder.layer[0].attention.self.query.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all())


@needs_transformers
def test_hf_roberta_replacement_and_position_extension():
    config = transformers.RobertaConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=34,  # 32 positions + 2 reserved
    )
    model = transformers.RobertaForMaskedLM(config).eval()
    old = model.roberta.embeddings.position_embeddings.weight.detach().clone()
    SparseAttentionUtils.extend_position_embedding(model, 64)
    new = model.roberta.embeddings.position_embeddings.weight
    assert new.shape == (66, 32) and model.config.max_position_embeddings == 66
    torch.testing.assert_close(new[2:34], old[2:])  # the learned rows, tiled
    torch.testing.assert_close(new[34:], old[2:])
    SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
        model, 64, BSLongformerSparsityConfig(num_heads=4, block=8)
    )
    assert model.config.max_position_embeddings == 66
    logits = model(input_ids=torch.randint(3, 50, (1, 64))).logits
    assert logits.shape == (1, 64, 50) and bool(torch.isfinite(logits).all())


@needs_transformers
def test_replacement_rejects_other_models_and_head_mismatch():
    with pytest.raises(ValueError, match="BERT"):
        SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
            torch.nn.Linear(2, 2), 64, FixedSparsityConfig(4)
        )
    with pytest.raises(ValueError, match="num_heads"):
        SparseAttentionUtils.replace_model_self_attention_with_sparse_self_attention(
            tiny_bert("eager"), 64, FixedSparsityConfig(8, block=4)
        )
