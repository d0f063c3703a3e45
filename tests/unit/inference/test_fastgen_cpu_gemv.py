"""FastGen's CPU GEMV kernel for 1-4 rows (fastgen/cpu_gemv): numerics against fp64,
independence from the other rows and the thread count, routing from the packed linear,
the switch, and bf16 engine tokens against HF bf16 ``generate`` up to its ties."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fastgen_helpers import engine_for

from shardspeed.inference.fastgen.cpu_prepack import prepack_linears
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.ops import cpu_gemv

DTYPES = sorted(cpu_gemv.kernel_dtypes(), key=str)
needs_kernel = pytest.mark.skipif(not DTYPES, reason="no AVX-512 GEMV kernel on this CPU")
needs_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in cpu_gemv.kernel_dtypes(), reason="no AVX-512-BF16 on this CPU"
)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [17, 48, 1000])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_kernel_matches_fp64(dtype: torch.dtype, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(k * 10 + rows)
    w = torch.randn(37, k, generator=gen).to(dtype)
    b = torch.randn(37, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    for bias in (b, None):
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = cpu_gemv.linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (rows, 37)
        if dtype == torch.float32:  # fp32 sums of k products: a few fp32 roundings
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        else:  # one bf16 rounding of the fp32 sum (relative 2^-8), sums of bf16 products
            torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-4 * k)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_sums_the_same_alone_beside_others_and_on_any_thread_count(dtype) -> None:
    """The order of each output's sum is fixed: batch size and threads do not change it."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    for k in (520, 1024):  # with and without a tail; 3-4 rows run as passes of two
        w = torch.randn(300, k, generator=gen).to(dtype)
        x = torch.randn(4, k, generator=gen).to(dtype)
        together = {m: cpu_gemv.linear(x[:m].contiguous(), w, None) for m in (2, 3, 4)}
        try:
            torch.set_num_threads(1)
            for r in range(4):
                alone = cpu_gemv.linear(x[r : r + 1].contiguous(), w, None)
                for m, out in together.items():
                    if r < m:
                        assert torch.equal(alone, out[r : r + 1]), (k, m, r)
        finally:
            torch.set_num_threads(threads)


@needs_kernel
def test_kernel_refuses_bad_shapes() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        cpu_gemv.linear(torch.randn(5, 16), w, None)
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        cpu_gemv.linear(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_gemv.linear(torch.randn(1, 16, dtype=torch.float64), w, None)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_linear_sends_few_rows_to_the_kernel(monkeypatch, dtype) -> None:
    calls: list[tuple[int, ...]] = []
    kernel = cpu_gemv.linear
    monkeypatch.setattr(
        cpu_gemv, "linear", lambda x, w, b: calls.append(x.shape) or kernel(x, w, b)
    )
    torch.manual_seed(0)
    layer = nn.Linear(64, 96).to(dtype).requires_grad_(False)
    assert prepack_linears(nn.Sequential(layer), (dtype,)) == 1
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2e-2}
    for shape in [(1, 64), (1, 1, 64), (2, 64), (1, 2, 64), (3, 64), (2, 2, 64)]:
        x = torch.randn(*shape).to(dtype)
        out = layer(x)
        assert out.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), **tol)
    # bf16: up to 4 rows (3 and 2 x 2 here); fp32: up to 2, then oneDNN
    want = [(1, 64), (1, 64), (2, 64), (2, 64)]
    assert cpu_gemv.max_rows(dtype, 64) == (4 if dtype == torch.bfloat16 else 2)
    if dtype == torch.bfloat16:
        want += [(3, 64), (4, 64)]
    assert calls == want
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # the kernel reads the parameter itself: never stale
    x = torch.randn(1, 64).to(dtype)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **tol)


@needs_bf16
def test_more_than_two_rows_only_while_the_activations_stay_small() -> None:
    """bf16 takes 3-4 rows while the rows fit in ACTIVATION_BYTES (16 KiB), 2 beyond."""
    assert cpu_gemv.max_rows(torch.bfloat16, 1024) == 4  # 4 x 1024 x 2 B = 8 KiB
    assert cpu_gemv.max_rows(torch.bfloat16, 2048) == 4  # 16 KiB
    assert cpu_gemv.max_rows(torch.bfloat16, 2816) == 2  # 3 rows would be 16.5 KiB
    assert cpu_gemv.max_rows(torch.bfloat16, 100_000) == 2
    assert cpu_gemv.max_rows(torch.float64, 64) == 0


def test_switch_off_and_bad_values(monkeypatch) -> None:
    try:
        monkeypatch.setenv("SHARDSPEED_FASTGEN_GEMV_CPU", "0")
        cpu_gemv.reset()
        assert cpu_gemv.kernel_dtypes() == frozenset()
        layer = nn.Linear(8, 8).requires_grad_(False)
        prepack_linears(nn.Sequential(layer), (torch.float32,))
        assert layer.forward.gemv_rows == 0  # type: ignore[attr-defined]
        monkeypatch.setenv("SHARDSPEED_FASTGEN_GEMV_CPU", "maybe")
        cpu_gemv.reset()
        with pytest.raises(ValueError, match="SHARDSPEED_FASTGEN_GEMV_CPU='maybe'"):
            cpu_gemv.kernel_dtypes()
    finally:
        monkeypatch.delenv("SHARDSPEED_FASTGEN_GEMV_CPU")
        cpu_gemv.reset()


def _bf16_step(value: float) -> float:
    """The spacing of bf16 numbers at ``value`` (8 significant bits)."""
    exponent = torch.frexp(torch.tensor(abs(value) or 1e-30))[1].item()
    return 2.0 ** (exponent - 8)


@needs_bf16
def test_bf16_engine_tokens_equal_hf_bf16_up_to_its_ties(tiny_llama, prompts) -> None:
    """Batch-1 decoding (every linear through the kernel) gives HF bf16 ``generate``'s
    greedy tokens, except where HF's own top logits are tied at bf16 resolution: at a first
    difference, HF's logit for our token is within one bf16 step of its maximum."""
    hf = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    engine = engine_for(tiny_llama, dtype=torch.bfloat16)
    assert any(getattr(m.__dict__.get("forward"), "gemv_rows", 0) for m in engine.model.modules())
    new = 24
    identical = 0
    for prompt in prompts[:6]:
        ours = engine.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))
        ours_ids = ours[0].output_token_ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )[0, len(prompt) :].tolist()
        if ours_ids == ref:
            identical += 1
            continue
        j = next(i for i in range(new) if ours_ids[i] != ref[i])
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref[:j]])).logits[0, -1].float()
        top = logits.max().item()
        gap = top - logits[ours_ids[j]].item()
        assert gap <= _bf16_step(top), (prompt, j, top, gap)
    assert identical >= 3  # ties are the exception, not the rule


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [17, 1000, 1024])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_int8_kernel_matches_fp64(dtype: torch.dtype, k: int, rows: int) -> None:
    """``scales * (x @ q.T)``, the definition of ``aten._weight_int8pack_mm``."""
    gen = torch.Generator().manual_seed(k + rows)
    q = torch.randint(-128, 128, (37, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(37, generator=gen) * 0.01).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    want = (x.double() @ q.double().T) * scales.double()
    got = cpu_gemv.linear_int8(x, q, scales)
    assert got.dtype == dtype and got.shape == (rows, 37)
    rtol = 1e-5 if dtype == torch.float32 else 2**-8  # fp32 sums; one bf16 rounding
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max())


@needs_kernel
def test_int8_weight_only_layers_use_the_kernel_for_few_rows(monkeypatch) -> None:
    from shardspeed.inference.quantization.kernels import QuantMeta, TorchInt8Kernel
    from shardspeed.inference.quantization.qtensor import quantize_weight

    calls: list[int] = []
    kernel = cpu_gemv.linear_int8
    monkeypatch.setattr(
        cpu_gemv, "linear_int8", lambda x, q, s: calls.append(x.shape[0]) or kernel(x, q, s)
    )
    torch.manual_seed(0)
    qw = quantize_weight(torch.randn(48, 64), bits=8, group_size=64, symmetric=True)
    int8 = TorchInt8Kernel()
    buffers = int8.pack(qw, torch.float32)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 64)
        got = int8.matmul(x, buffers, QuantMeta(qw))
        want = torch.ops.aten._weight_int8pack_mm(x, buffers["qweight"], buffers["scales"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1, 2]  # 3 rows: torch's kernel


def test_torch_int8_kernel_refused_where_it_is_wrong_for_bf16() -> None:
    """torch's CPU int8 kernel crashes or returns garbage for bf16 activations when K is not
    a multiple of 16; such layers take the reference kernel instead."""
    from shardspeed.inference.quantization.kernels import TorchInt8Kernel
    from shardspeed.inference.quantization.qtensor import quantize_weight

    cpu = torch.device("cpu")
    int8 = TorchInt8Kernel()
    for k, bad in ((24, True), (1000, True), (32, False), (1008, False)):
        qw = quantize_weight(torch.randn(8, k), bits=8, group_size=k, symmetric=True)
        why = int8.supports(qw, cpu, torch.bfloat16)
        assert (why is not None) == bad and (not bad or "multiple of 16" in why)
        assert int8.supports(qw, cpu, torch.float32) is None
