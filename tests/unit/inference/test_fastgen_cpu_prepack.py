"""CPU pre-packed linear weights (fastgen/cpu_prepack.py): decisions, numerics, staleness."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fastgen_helpers import engine_for

from shardspeed.inference.fastgen import cpu_prepack
from shardspeed.inference.fastgen.cpu_prepack import (
    _fp32_by_default,
    _native_dtypes,
    _widened_dtypes,
    is_prepacked,
    prepack_linears,
    resolve_prepack,
)
from shardspeed.inference.fastgen.sampling_params import SamplingParams

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)
needs_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in _native_dtypes(), reason="no oneDNN bf16 kernels on this CPU"
)


def _resolve(requested, dtype=torch.bfloat16, device=CPU, compiled=False, offloaded=False):
    return resolve_prepack(requested, device, dtype, compiled=compiled, offloaded=offloaded)


@needs_onednn
def test_decisions() -> None:
    # fp32 (another summation order than MKL's) by default only where measured faster
    assert _resolve(None, torch.float32) == _fp32_by_default()
    assert _resolve(False) == ()
    assert torch.float32 in _resolve(True, torch.float32)
    assert _resolve(None, compiled=True) == ()  # Inductor packs its own
    assert _resolve(None, offloaded=True) == ()  # streamed layers would repack per load
    assert _resolve(None, device=torch.device("cuda")) == ()
    auto_16 = (*_native_dtypes(), *_widened_dtypes())
    assert _resolve(None) == tuple(d for d in auto_16 if d == torch.bfloat16)
    assert _resolve(None, torch.float16) == tuple(d for d in auto_16 if d == torch.float16)
    assert not set(_native_dtypes()) & set(_widened_dtypes())


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_forward_without_native_16_bit_kernels(monkeypatch, dtype) -> None:
    """On a CPU without oneDNN bf16 / fp16 kernels (AVX2) the weight is packed as fp32: a
    product of several rows sums the exact products in fp32 and rounds once (within one
    step of the dtype of the exact result); one row goes to ``F.linear`` (torch's GEMV on
    the 16-bit weight), bitwise; in-place updates are followed."""
    monkeypatch.setattr(cpu_prepack, "_native_dtypes", lambda: ())  # every CPU takes the path
    torch.manual_seed(0)
    layer = nn.Linear(384, 80).to(dtype).requires_grad_(False)
    assert prepack_linears(nn.Sequential(layer), (dtype,)) == 1
    assert layer.forward.widened  # type: ignore[attr-defined]

    def exact(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.double(), layer.weight.double(), layer.bias.double())

    def bound(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """One step of the dtype at the result, plus fp32 summation's worst case over the
        384 products (384 * 2^-24 * sum |x w|; it matters for results near zero)."""
        exponent = torch.frexp(ref.abs().clamp_min(1e-30))[1].double()
        mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
        step = torch.ldexp(torch.ones_like(ref), exponent - mantissa - 1)
        terms = F.linear(x.double().abs(), layer.weight.double().abs(), layer.bias.double().abs())
        return step + 384 * 2.0**-24 * terms

    for rows in (2, 5, 33):
        x = torch.randn(rows, 384).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 80)
        ref = exact(x)
        assert ((out.double() - ref).abs() <= bound(x, ref)).all()
    one = torch.randn(1, 384).to(dtype)
    assert torch.equal(layer(one), F.linear(one, layer.weight, layer.bias))
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # an in-place update must not be served stale
    x = torch.randn(4, 384).to(dtype)
    ref = exact(x)
    assert ((layer(x).double() - ref).abs() <= bound(x, ref)).all()


@pytest.mark.parametrize(
    ("requested", "kwargs", "match"),
    [
        ("yes", {}, "must be None"),
        (True, {"compiled": True}, "compile_decode"),
        (True, {"offloaded": True}, "offload"),
        (True, {"device": torch.device("cuda")}, "device cuda"),
    ],
)
def test_refusals_name_the_setting(requested, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match) as err:
        _resolve(requested, **kwargs)
    assert "cpu_prepack" in str(err.value)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_matches_and_follows_in_place_updates(dtype) -> None:
    if dtype == torch.bfloat16 and torch.bfloat16 not in _native_dtypes():
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    torch.manual_seed(0)
    layer = nn.Linear(48, 80).to(dtype).requires_grad_(False)
    seen = []
    layer.register_forward_hook(lambda m, i, o: seen.append(o.shape))  # hooks keep firing
    x = torch.randn(3, 5, 48, dtype=dtype)
    ref = F.linear(x, layer.weight, layer.bias)
    assert prepack_linears(nn.Sequential(layer), (dtype,)) == 1 and is_prepacked(layer)
    out = layer(x)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)  # the same oneDNN kernel as F.linear
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # an in-place update must not be served stale
    torch.testing.assert_close(
        layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), rtol=1e-2, atol=1e-2
    )
    with torch.no_grad():
        layer.weight.data = torch.zeros_like(layer.weight)  # a new storage as well
    assert torch.equal(layer(x), layer.bias.expand(3, 5, 80))
    assert len(seen) == 3


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_fp32_weights_are_laid_out_for_batched_rows(monkeypatch, rows: int) -> None:
    """fp32 weights are packed for FP32_PACK_ROWS rows (measured faster for 8-32 rows), bf16
    for 1 (bitwise F.linear); every row count stays within fp32 rounding of F.linear."""
    from shardspeed.inference.fastgen import cpu_prepack
    from shardspeed.ops import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "available", lambda: False)  # oneDNN's layout, not the AVX2 one
    hints = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(
        torch.ops.mkldnn, "_reorder_linear_weight", lambda w, n: hints.append(n) or reorder(w, n)
    )
    torch.manual_seed(0)
    layers = [nn.Linear(384, 576, bias=False).requires_grad_(False) for _ in range(2)]
    prepack_linears(nn.Sequential(layers[0]), (torch.float32,))
    assert hints == [cpu_prepack.FP32_PACK_ROWS] and cpu_prepack.FP32_PACK_ROWS > 1
    if torch.bfloat16 in _native_dtypes():
        prepack_linears(nn.Sequential(layers[1].to(torch.bfloat16)), (torch.bfloat16,))
        assert hints[1:] == [1]
    x = torch.randn(rows, 384)
    ref = F.linear(x.double(), layers[0].weight.double()).float()
    torch.testing.assert_close(layers[0](x), ref, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_subclasses_are_left_alone() -> None:
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4))
    assert prepack_linears(model, (torch.bfloat16,)) == 0  # fp32 weights, bf16 asked
    assert prepack_linears(model, ()) == 0
    assert not any(is_prepacked(m) for m in model)


@needs_bf16
def test_bf16_engine_tokens_bitwise_equal_with_and_without(monkeypatch, tiny_llama, prompts):
    """Packing alone is bitwise ``F.linear`` in bf16 (the 1-2-row GEMV kernel, which sums in
    its own order, is switched off here; test_fastgen_cpu_gemv.py covers it)."""
    from shardspeed.ops import cpu_gemv

    monkeypatch.setattr(cpu_gemv, "_state", {**cpu_gemv._state, "dtypes": frozenset()})
    params = SamplingParams(max_new_tokens=6)

    def run(**kwargs):
        engine = engine_for(tiny_llama, dtype=torch.bfloat16, **kwargs)
        packed = any(is_prepacked(m) for m in engine.model.modules())
        ids = [engine.add_request(p, params) for p in prompts[:6]]
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        return packed, [got[i] for i in ids]

    packed_on, on = run()
    packed_off, off = run(cpu_prepack=False)
    assert packed_on and not packed_off
    assert on == off


def test_serve_cli_flag() -> None:
    from shardspeed.launcher.serve_cmd import _ENGINE_KEYS, build_parser

    assert "cpu_prepack" in _ENGINE_KEYS
    assert build_parser().parse_args(["m"]).cpu_prepack is None
    assert build_parser().parse_args(["m", "--cpu-prepack"]).cpu_prepack is True
    assert build_parser().parse_args(["m", "--no-cpu-prepack"]).cpu_prepack is False


@needs_onednn
@needs_bf16
def test_worker_models_are_packed_like_the_engine() -> None:
    """Tensor / pipeline / expert-parallel ranks and draft models: auto packs bf16, not
    fp32; ``True`` packs fp32 too; ``False`` nothing."""
    from shardspeed.inference.fastgen.cpu_prepack import pack_worker_model

    cpu = torch.device("cpu")

    def model(dtype: torch.dtype) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(dtype)

    assert pack_worker_model(model(torch.bfloat16), None, cpu) == 2
    assert pack_worker_model(model(torch.float32), None, cpu) == 2 * bool(_fp32_by_default())
    assert pack_worker_model(model(torch.float32), True, cpu) == 2
    assert pack_worker_model(model(torch.bfloat16), False, cpu) == 0
    assert pack_worker_model(nn.ReLU(), None, cpu) == 0  # no parameters at all


def test_packing_logs_the_memory_it_adds(monkeypatch, caplog) -> None:
    """The log names the packed copies' bytes (and the widened ones), and how to opt out."""
    monkeypatch.setattr(cpu_prepack, "_native_dtypes", lambda: ())  # bf16 is widened here
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 1024)).to(torch.bfloat16)
    with caplog.at_level("INFO", logger=cpu_prepack.logger.name):
        assert prepack_linears(model, (torch.bfloat16,)) == 2
    text = caplog.text
    extra = sum(m.forward.packed.numel() * m.forward.packed.element_size() for m in model)
    assert extra >= 2 * 1024 * 512 * 4  # two fp32 copies of 1024 x 512
    assert f"{extra / 2**20:.1f} MiB more memory" in text and "cpu_prepack=False" in text, text
    assert "2 of them widened to fp32 copies" in text, text
    from shardspeed.ops import cpu_gemm

    kernel = "the AVX2 GEMM kernel" if cpu_gemm.available() else "oneDNN"
    assert f"2 linear weights packed for {kernel} " in text, text
