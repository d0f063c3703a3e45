"""FastGen's fused CPU kernels (RMSNorm, residual add + RMSNorm, RoPE, SiLU x up) give the
eager ops' results, and the engine gives the same tokens with them on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardspeed.inference.fastgen import cpu_fused
from shardspeed.inference.fastgen.models.layers import RMSNorm
from shardspeed.inference.fastgen.models.rope import apply_rope

pytestmark = pytest.mark.skipif(
    not cpu_fused.kernel_available(), reason="the fused CPU kernels do not build here"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def _avx512() -> bool:
    return "avx512f" in _cpu_flags()


# Bitwise where torch runs its AVX-512 kernels and the kernel is built with AVX-512 (the
# same exp for silu); otherwise each element within one ulp of its dtype.
BITWISE = _avx512() and torch.backends.cpu.get_cpu_capability() == "AVX512"
# silu_mul also follows torch's AVX2 kernel (its exp and vector spans) on an AVX2 CPU
# without AVX-512, where torch runs its AVX2 kernels.
SILU_BITWISE = BITWISE or (
    not _avx512()
    and {"avx2", "f16c"} <= _cpu_flags()
    and torch.backends.cpu.get_cpu_capability() == "AVX2"
)


def _same(got: torch.Tensor, ref: torch.Tensor, bitwise: bool = BITWISE) -> None:
    if bitwise:
        assert torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0)), (
            (got.float() - ref.float()).abs().max()
        )
        assert torch.equal(got.isnan(), ref.isnan())
    else:
        eps = torch.finfo(ref.dtype).eps
        torch.testing.assert_close(
            got.float(), ref.float(), rtol=2 * eps, atol=1e-6, equal_nan=True
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_and_residual_add_match_eager(dtype: torch.dtype, offset: float) -> None:
    torch.manual_seed(0)
    for rows, hidden in [(1, 384), (7, 1000), (130, 2048)]:
        base = (torch.randn(rows, hidden + 16) * 3).to(dtype)
        x = base[:, 8 : 8 + hidden]  # rows with a stride, as a split would give
        a = torch.randn(rows, hidden).to(dtype)
        norm = RMSNorm(hidden, 1e-6, offset).to(dtype)
        norm.weight.data = torch.randn(hidden).to(dtype)
        with torch.inference_mode():
            ref = norm._eager(x)
            _same(cpu_fused.rms_norm(x, norm.weight, 1e-6, offset), ref)
            _same(norm(x), ref)  # the module takes the fused path
            s, h = norm.add_forward(x, a)
            assert torch.equal(s, x + a)
            _same(h, norm._eager(x + a))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot", [64, 32])
def test_rope_in_place_matches_eager(dtype: torch.dtype, rot: int) -> None:
    torch.manual_seed(1)
    n, heads, d = 9, 6, 64
    qkv = torch.randn(n, heads * d * 3).to(dtype)
    q = qkv[:, heads * d : 2 * heads * d].view(n, heads, d)  # a strided view, like k
    cos, sin = torch.randn(n, rot).to(dtype), torch.randn(n, rot).to(dtype)
    ref = apply_rope(q, cos, sin)
    untouched = qkv[:, : heads * d].clone()
    out = cpu_fused.rope_(q, cos, sin)
    assert out.data_ptr() == q.data_ptr()  # in place
    _same(q, ref)
    assert torch.equal(qkv[:, : heads * d], untouched)  # the rest of the row is not touched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    for rows, inter in [(1, 64), (5, 1000), (33, 2816), (3, 7)]:  # tails not multiple of 64
        gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype)
        # special values in the vector span and in the scalar tail
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -100.0])
        gate_up[0, : min(inter, 6)] = special[: min(inter, 6)].to(dtype)
        gate_up[-1, inter - 3 : inter] = special[:3].to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        _same(cpu_fused.silu_mul(gate_up), F.silu(gate) * up, SILU_BITWISE)


def test_active_only_outside_autograd_and_when_enabled() -> None:
    x = torch.randn(2, 8)
    assert cpu_fused.active(x)
    w = torch.randn(2, 8, requires_grad=True)
    assert not cpu_fused.active(w)  # autograd records eager ops
    with torch.no_grad():
        assert cpu_fused.active(w)
    try:
        cpu_fused.set_enabled(False)
        assert not cpu_fused.active(x)
    finally:
        cpu_fused.set_enabled(None)


def test_bad_environment_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSPEED_FASTGEN_FUSED_CPU", "maybe")
    cpu_fused.set_enabled(None)  # the environment is read again at the next use
    try:
        with pytest.raises(ValueError, match="SHARDSPEED_FASTGEN_FUSED_CPU='maybe'"):
            cpu_fused.active(torch.zeros(1, 4))
        monkeypatch.setenv("SHARDSPEED_FASTGEN_FUSED_CPU", "0")
        assert not cpu_fused.active(torch.zeros(1, 4))
    finally:
        cpu_fused.set_enabled(None)


def _tiny(model_type: str, tmp_path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": 16} if model_type in ("gemma", "qwen3") else {}
    config = AutoConfig.for_model(
        model_type, vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra,
    )  # fmt: skip
    torch.manual_seed(3)
    path = tmp_path / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type", ["llama", "gemma", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_tokens_equal_with_and_without_fused_kernels(
    model_type: str, dtype: torch.dtype, tmp_path
) -> None:
    from shardspeed.inference.fastgen.engine import InferenceEngine
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    engine = InferenceEngine.from_pretrained(_tiny(model_type, tmp_path), dtype=dtype)
    prompts = [[5, 9, 17, 3, 44, 2, 8] * k for k in (1, 3, 6)]

    def generate() -> list[list[int]]:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        return [o.output_token_ids for o in engine.generate(prompts, params)]

    try:
        cpu_fused.set_enabled(False)
        eager = generate()
        cpu_fused.set_enabled(True)
        fused = generate()
    finally:
        cpu_fused.set_enabled(None)
    assert fused == eager
