"""The AVX2 fp32 GEMM kernel (ops/cpu_gemm) behind FastGen's packed linears: numerics against
fp64 over odd shapes, a row's result independent of the rows beside it and the thread count,
refusals, the routing from cpu_prepack (fp32 and widened 16-bit weights) and its switch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardspeed.inference.fastgen import cpu_prepack
from shardspeed.inference.fastgen.cpu_prepack import is_prepacked, prepack_linears
from shardspeed.ops import cpu_gemm

needs_kernel = pytest.mark.skipif(
    not cpu_gemm.available(), reason="the GEMM kernel is for CPUs with AVX2 and no AVX-512"
)


def _fp32_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 summation's worst case over K products in any order (K * 2^-24 * sum |x w|)."""
    terms = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    return (x.shape[1] + 1) * 2.0**-24 * terms + 1e-30


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
@pytest.mark.parametrize("k", [1, 7, 256, 257, 600])
def test_kernel_matches_fp64(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    packed = cpu_gemm.pack(w)
    assert packed.numel() == -(-n // 16) * 16 * k
    for m in (1, 2, 3, 5, 6, 7, 13, 27, 130):  # tiles of 1-6 rows, groups of up to 20 tiles
        x = torch.randn(m, k, generator=gen)
        for bias in (b, None):
            got = cpu_gemm.linear(x, packed, n, bias)
            assert got.shape == (m, n) and got.dtype == torch.float32
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert ((got.double() - want).abs() <= _fp32_bound(x, w, bias)).all(), (m, bias)


@needs_kernel
def test_a_row_sums_the_same_alone_beside_others_and_on_any_thread_count() -> None:
    """Each output's order of summation is fixed: the batch around a row and the thread count
    do not change its bits (a sequence's logits do not depend on what runs beside it)."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    w = torch.randn(200, 700, generator=gen)
    packed = cpu_gemm.pack(w)
    b = torch.randn(200, generator=gen)
    x = torch.randn(150, 700, generator=gen)
    batches = {m: cpu_gemm.linear(x[:m].contiguous(), packed, 200, b) for m in (7, 32, 150)}
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for r in (0, 3, 6):
                alone = cpu_gemm.linear(x[r : r + 1].contiguous(), packed, 200, b)
                for m, out in batches.items():
                    assert torch.equal(alone, out[r : r + 1]), (t, m, r)
            assert torch.equal(cpu_gemm.linear(x, packed, 200, b), batches[150])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_kernel_refuses_bad_input() -> None:
    w = torch.randn(20, 16)
    packed = cpu_gemm.pack(w)
    with pytest.raises(RuntimeError, match="contiguous 2-D fp32"):
        cpu_gemm.pack(w.double())
    with pytest.raises(RuntimeError, match="contiguous 2-D fp32"):
        cpu_gemm.pack(torch.randn(16, 20).T)
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D fp32"):
        cpu_gemm.linear(torch.randn(3, 16).bfloat16(), packed, 20, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_gemm.linear(torch.randn(3, 15), packed, 20, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_gemm.linear(torch.randn(3, 16), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_gemm.linear(torch.randn(3, 16), packed, 20, torch.randn(19))
    assert cpu_gemm.linear(torch.randn(0, 16), packed, 20, None).shape == (0, 20)


@needs_kernel
def test_packed_linears_route_fp32_and_widened_products_here(monkeypatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear", lambda x, *a: calls.append(x.shape) or real(x, *a))
    torch.manual_seed(0)
    layer = nn.Linear(64, 40).requires_grad_(False)
    half = nn.Linear(64, 40).to(torch.bfloat16).requires_grad_(False)
    monkeypatch.setattr(cpu_prepack, "_native_dtypes", lambda: ())  # bf16 widened to fp32
    assert prepack_linears(nn.Sequential(layer), (torch.float32,)) == 1
    assert prepack_linears(nn.Sequential(half), (torch.bfloat16,)) == 1
    assert layer.forward.gemm and half.forward.gemm  # type: ignore[attr-defined]
    x = torch.randn(2, 3, 64)  # a 3-D input: flattened to 6 rows and back
    out = layer(x)
    assert out.shape == (2, 3, 40) and calls == [(6, 64)]
    assert ((out - F.linear(x, layer.weight, layer.bias)).abs() <= 1e-5).all()
    xb = torch.randn(5, 64).to(torch.bfloat16)
    want = F.linear(xb.double(), half.weight.double(), half.bias.double())
    got = half(xb)
    assert got.dtype == torch.bfloat16 and calls[-1] == (5, 64)
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-3).all()
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in-place updates are repacked, never served stale
    assert ((layer(x) - F.linear(x, layer.weight, layer.bias)).abs() <= 1e-5).all()


def test_switch_sends_fp32_back_to_onednn(monkeypatch) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setenv("SHARDSPEED_FASTGEN_GEMM_CPU", "0")
    cpu_gemm.reset()
    try:
        assert not cpu_gemm.available()
        layer = nn.Linear(32, 24).requires_grad_(False)
        prepack_linears(nn.Sequential(layer), (torch.float32,))
        assert is_prepacked(layer) and not layer.forward.gemm  # type: ignore[attr-defined]
        monkeypatch.setenv("SHARDSPEED_FASTGEN_GEMM_CPU", "maybe")
        cpu_gemm.reset()
        with pytest.raises(ValueError, match="SHARDSPEED_FASTGEN_GEMM_CPU='maybe'"):
            cpu_gemm.available()
    finally:
        monkeypatch.delenv("SHARDSPEED_FASTGEN_GEMM_CPU")
        cpu_gemm.reset()
