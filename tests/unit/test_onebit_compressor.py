"""1-bit compression (pure functions) and the 1-bit optimizers' math in one process.

Compressor: bit packing round trips and bit order, chunk layouts, the wire format and its
size, per-chunk RMS scales, and error feedback (the compressed values plus the last error
sum exactly to the inputs, so their sum tracks the uncompressed sum). Optimizers (world 1,
no process group): warm-up equals torch AdamW / ShardSpeed's LAMB, the factory accepts
DeepSpeed's names and parameters, and state_dict round trips the error buffers.
"""

from __future__ import annotations

import pytest
import torch

from shardspeed.optim import build_optimizer
from shardspeed.optim.onebit import CompressedAllReduce, OnebitAdam, OnebitLamb, ZeroOneAdam
from shardspeed.optim.onebit.compressor import (
    SCALE_BYTES,
    chunk_layout,
    compress,
    compress_with_feedback,
    decode,
    decompress,
    encode,
    pack_bits,
    unpack_bits,
)

# -- packing and layout ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8,), (64,), (3, 8000), (5, 16)])
def test_pack_unpack_round_trip(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    bits = torch.rand(shape, generator=g) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], shape[-1] // 8)
    assert torch.equal(unpack_bits(packed), bits)


def test_pack_paths_agree() -> None:
    """numpy's packbits (CPU) and the tensor-op path (other devices) give the same bytes."""
    from shardspeed.optim.onebit.compressor import _pack_bits_tensor_ops

    bits = torch.rand(7, 4096, generator=torch.Generator().manual_seed(4)) > 0.3
    assert torch.equal(_pack_bits_tensor_ops(bits), pack_bits(bits))


def test_pack_bit_order_is_msb_first() -> None:
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [129, 64]


def test_pack_rejects_partial_bytes() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(torch.ones(7, dtype=torch.bool))


def test_chunk_layout() -> None:
    layout = chunk_layout(10, 2)
    assert (layout.chunk_numel, layout.padded_numel) == (8, 16)
    assert layout.real_counts() == [8, 2]
    assert layout.wire_row_bytes == SCALE_BYTES + 1
    assert chunk_layout(0, 4).real_counts() == [0, 0, 0, 0]
    big = chunk_layout(1_000_001, 4)  # chunks of whole 1024-element scale blocks
    assert big.block_numel == 1024 and big.chunk_numel % 1024 == 0
    assert big.padded_numel - big.numel < 1024 * 4
    assert big.wire_row_bytes == SCALE_BYTES * big.blocks_per_chunk + big.chunk_numel // 8
    assert chunk_layout(5000, 2).block_counts(1) == [1024, 904, 0]  # chunks of 3 blocks
    with pytest.raises(ValueError):
        chunk_layout(5, 0)


# -- compression ----------------------------------------------------------------------------


def test_compress_signs_and_rms_scales() -> None:
    g = torch.Generator().manual_seed(1)
    layout = chunk_layout(21, 3)  # chunks of 8: real counts 8, 8, 5
    x = torch.zeros(layout.padded_numel)
    x[:21] = torch.randn(21, generator=g)
    x[3] = 0.0  # zero counts as positive
    signs, scales = compress(x.view(3, 8), layout.real_counts())
    values = decompress(signs, scales).view(-1)
    expected_sign = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(torch.sign(values[:21]), expected_sign[:21])
    for c, count in enumerate(layout.real_counts()):
        chunk = x[c * 8 : c * 8 + count]
        assert scales[c].item() == pytest.approx(chunk.pow(2).mean().sqrt().item(), rel=1e-6)
        # the decompressed chunk keeps the chunk's norm
        norm = values[c * 8 : c * 8 + count].norm().item()
        assert norm == pytest.approx(chunk.norm().item(), rel=1e-5)


def test_wire_round_trip_and_size() -> None:
    g = torch.Generator().manual_seed(2)
    layout = chunk_layout(4096, 4)
    x = torch.randn(4, layout.chunk_numel, generator=g)
    signs, scales = compress(x, layout.real_counts())
    rows = encode(signs, scales)
    assert rows.dtype == torch.uint8 and rows.shape == (4, layout.wire_row_bytes)
    # 1 bit per element plus one fp32 scale per chunk: 32x smaller than fp32, minus scales
    assert rows.numel() == 4096 // 8 + 4 * SCALE_BYTES
    signs2, scales2 = decode(rows)
    assert torch.equal(signs2, signs) and torch.equal(scales2.view(-1), scales)
    # several scale blocks per chunk: 4 bytes per block in front of the signs
    layout = chunk_layout(10_000, 2)
    chunks = torch.zeros(2, layout.chunk_numel)
    chunks.view(-1)[:10_000] = torch.randn(10_000, generator=g)
    error = torch.zeros_like(chunks)
    signs, scales = compress_with_feedback(chunks.clone(), error, layout)
    rows = encode(signs, scales)
    assert rows.shape == (2, layout.wire_row_bytes) and layout.blocks_per_chunk == 5
    signs2, scales2 = decode(rows, layout.blocks_per_chunk)
    assert torch.equal(signs2, signs) and torch.equal(scales2, scales)
    restored = (decompress(signs2, scales2) + error).view(-1)[:10_000]  # padding is dropped
    torch.testing.assert_close(restored, chunks.view(-1)[:10_000])


@pytest.mark.parametrize("numel, num_chunks", [(1000, 4), (6000, 2)])  # 1 and 3 blocks a chunk
def test_error_feedback_tracks_the_uncompressed_sum(numel: int, num_chunks: int) -> None:
    """sum_t decompress(compress(x_t + e_{t-1})) + e_T == sum_t x_t, and e_T stays bounded."""
    g = torch.Generator().manual_seed(3)
    layout = chunk_layout(numel, num_chunks)
    block_counts = [n for c in range(num_chunks) for n in layout.block_counts(c)]
    error = torch.zeros(num_chunks, layout.chunk_numel)
    total_in = torch.zeros(layout.padded_numel)
    total_out = torch.zeros(layout.padded_numel)
    total_plain = torch.zeros(layout.padded_numel)  # the same compression without feedback
    bias = torch.linspace(-0.5, 0.5, numel)  # a consistent signal under the noise
    for _ in range(200):
        x = torch.zeros(layout.padded_numel)
        x[:numel] = bias + torch.randn(numel, generator=g)
        total_in += x
        signs, scales = compress_with_feedback(x.clone().view(num_chunks, -1), error, layout)
        assert scales.shape == (num_chunks, layout.blocks_per_chunk)
        total_out += decompress(signs, scales).view(-1)
        plain = compress(x.view(-1, layout.block_numel), block_counts)
        total_plain += decompress(*plain).view(-1)
    total_out[numel:] = 0  # padding is never real
    assert torch.allclose(total_out + error.view(-1), total_in, atol=1e-3)
    assert error.view(-1)[numel:].abs().max() == 0  # padding carries no error
    drift = (total_out - total_in).norm() / total_in.norm()
    drift_plain = (total_plain[:numel] - total_in[:numel]).norm() / total_in.norm()
    assert drift < 0.05, drift
    assert drift_plain > 5 * drift, (drift_plain, drift)


def test_compressed_allreduce_world_one_is_identity() -> None:
    reduce = CompressedAllReduce(None, 1, 0)
    x = torch.randn(37)
    errors = reduce.new_errors(37, x.device)
    assert torch.equal(reduce(x, errors), x)


# -- optimizers in one process ----------------------------------------------------------------


def _tensors(seed: int, sizes: tuple[int, ...] = (48, 20)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_onebit_adam_warmup_equals_adamw() -> None:
    ours, ref = _tensors(0), _tensors(0)
    hp = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99)}
    opt = OnebitAdam(ours, freeze_step=10, **hp)
    torch_opt = torch.optim.AdamW(ref, foreach=False, **hp)
    _run(opt, ours, 10, seed=5)
    _run(torch_opt, ref, 10, seed=5)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_onebit_adam_freezes_variance_after_warmup() -> None:
    params = _tensors(1)
    opt = OnebitAdam(params, lr=1e-2, freeze_step=3)
    _run(opt, params, 3, seed=6)
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    _run(opt, params, 4, seed=7)
    for p, v in zip(params, frozen):
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert opt.state[p]["variance_steps"] == 3 and opt.state[p]["step"] == 7


def test_zero_one_adam_full_precision_steps_equal_adamw() -> None:
    ours, ref = _tensors(2), _tensors(2)
    opt = ZeroOneAdam(ours, lr=1e-2, var_update_scaler=4)  # steps 1-4: full precision
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, foreach=False)
    _run(opt, ours, 4, seed=8)
    _run(torch_opt, ref, 4, seed=8)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opt.state[ours[0]]["var_interval"] == 2


def test_onebit_lamb_warmup_equals_lamb_per_segment() -> None:
    """One flat master holding two parameters (segments) steps like LAMB on the two."""
    from shardspeed.ops.lamb import Lamb

    a, b = _tensors(3, (30, 12))
    flat = torch.cat([a, b])
    opt = OnebitLamb([flat], lr=1e-2, weight_decay=0.01, freeze_step=10)
    opt.set_param_segments([[[(0, 30), (30, 12)]]])
    ref = [a.clone(), b.clone()]
    lamb = Lamb(ref, lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        grads = [torch.randn(30, generator=g), torch.randn(12, generator=g)]
        flat.grad = torch.cat(grads)
        for p, grad in zip(ref, grads):
            p.grad = grad
        opt.step()
        lamb.step()
        torch.testing.assert_close(opt.get_lamb_coeffs(), lamb.get_lamb_coeffs(), rtol=1e-5, atol=0)
    torch.testing.assert_close(flat, torch.cat(ref), rtol=1e-6, atol=1e-7)
    coeffs = opt.param_groups[0]["lamb_coeff_freeze"][0]
    assert len(coeffs) == 2 and all(c > 0 for c in coeffs)


def test_onebit_lamb_compression_stage_runs_single_process() -> None:
    params = _tensors(4)
    opt = OnebitLamb(params, lr=1e-2, freeze_step=2)
    _run(opt, params, 5, seed=10)
    group = opt.param_groups[0]
    assert [len(c) for c in group["scaling_coeff"]] == [1, 1]
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_onebit_lamb_frozen_trust_ratio_is_bias_corrected(bias_correction: bool) -> None:
    """Issue 31: the trust-ratio EMA starts at 0, so after a 10-step warm-up it holds
    1 - 0.9**10 = 0.65 of the ratio. With bias_correction the compression stage divides
    that out (the first compressed coefficient is corrected EMA * factor, factor starting
    within 10% of 1); without it the raw EMA applies, as in DeepSpeed 0.19.6."""
    params = _tensors(12)
    opt = OnebitLamb(params, lr=1e-2, freeze_step=10, bias_correction=bias_correction)
    _run(opt, params, 10, seed=13)
    group = opt.param_groups[0]
    emas = [c[0] for c in group["lamb_coeff_freeze"]]
    assert [c[0] for c in group["lamb_coeff_count"]] == [10.0, 10.0]
    _run(opt, params, 1, seed=14)
    factors = [f[0] for f in group["last_factor"]]
    expected = [
        ema / (1 - 0.9**10 if bias_correction else 1.0) * f for ema, f in zip(emas, factors)
    ]
    torch.testing.assert_close(opt.get_lamb_coeffs(), expected, rtol=1e-12, atol=0)
    assert all(0.9 <= f <= 1.1 for f in factors)


def test_onebit_lamb_warns_short_freeze_step_once(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from shardspeed.utils import logging as ss_logging

    ss_logging._once.cache_clear()
    logger = logging.getLogger("shardspeed")  # does not propagate: attach caplog's handler
    logger.addHandler(caplog.handler)
    try:
        OnebitLamb(_tensors(15), freeze_step=10)
        OnebitLamb(_tensors(15), freeze_step=10)
        OnebitLamb(_tensors(15), freeze_step=50)  # 50 * (1 - 0.9) = 5: long enough
    finally:
        logger.removeHandler(caplog.handler)
        ss_logging._once.cache_clear()
    hits = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(hits) == 1
    assert "OneBitLamb: freeze_step=10" in hits[0] and "freeze_step >= 50" in hits[0]


def test_state_dict_round_trips_error_buffers() -> None:
    params = _tensors(5)
    opt = OnebitAdam(params, lr=1e-2, freeze_step=1)
    _run(opt, params, 3, seed=11)
    sd = opt.state_dict()
    assert sorted(sd["rank_local"]) == [
        "g0.m0.server_error",
        "g0.m0.worker_error",
        "g0.m1.server_error",
        "g0.m1.worker_error",
    ]
    sd["rank_local"]["g0.m0.worker_error"].fill_(0.25)
    fresh = OnebitAdam(_tensors(5), lr=1e-2, freeze_step=1)
    fresh.load_state_dict(sd)
    assert fresh.rank_local_state()["g0.m0.worker_error"].eq(0.25).all()
    assert fresh.state[fresh.param_groups[0]["params"][0]]["step"] == 3


# -- the factory ------------------------------------------------------------------------------


def test_factory_builds_deepspeed_types_with_deepspeed_params() -> None:
    common = {"lr": 1e-3, "cuda_aware": False, "comm_backend_name": "nccl"}
    adam = build_optimizer("OneBitAdam", {**common, "freeze_step": 400}, _tensors(0))
    assert isinstance(adam, OnebitAdam) and adam.freeze_step == 400
    zo = build_optimizer(
        "ZeroOneAdam",
        {
            **common,
            "var_freeze_step": 1000,
            "var_update_scaler": 16,
            "local_step_scaler": 1000,
            "local_step_clipper": 16,
        },
        _tensors(0),
    )
    assert isinstance(zo, ZeroOneAdam) and zo.local_step_scaler == 1000
    lamb = build_optimizer(
        "onebitlamb",
        {
            **common,
            "freeze_step": 100,
            "max_coeff": 0.3,
            "min_coeff": 0.01,
            "coeff_beta": 0.9,
            "factor_max": 4.0,
            "factor_min": 0.5,
            "factor_threshold": 0.1,
        },
        _tensors(0),
    )
    assert isinstance(lamb, OnebitLamb) and lamb.factor_threshold == 0.1
    for opt in (adam, zo, lamb):
        assert opt.reduces_gradients


@pytest.mark.parametrize(
    "params, match",
    [
        ({"freeze_stp": 5}, "freeze_step"),
        ({"comm_backend_name": "carrier-pigeon"}, "comm_backend_name"),
        ({"amsgrad": True}, "amsgrad"),
    ],
)
def test_factory_rejects_bad_params(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_optimizer("OneBitAdam", params, _tensors(0))


def test_factory_rejects_offload() -> None:
    with pytest.raises(ValueError, match="offload_optimizer"):
        build_optimizer("OneBitAdam", {}, _tensors(0), offload=True)
