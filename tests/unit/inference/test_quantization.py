"""Weight-only int8 / int4 quantization (shardspeed.inference.quantization).

Oracles: the dequantize-on-the-fly reference path (fp32 math) for the torch kernels;
a plain ``nn.Linear`` / HF model whose weights are replaced by the dequantized ones
for the module swap (GPT-2 ``Conv1D`` included); HF ``generate`` on that model for
``pipeline(quantization=...)``.

Tolerances:
* round trip: ``|W - deq(q(W))| <= scale / 2`` per element (round to nearest), + 1e-6.
* kernel in fp32 compute vs reference: 1e-5 relative to ``max|y|`` (same math, other order).
* kernel in bf16 compute (the default) vs fp32 math on what the kernel holds (bf16-rounded
  input, bf16 scale/zero tables): ``2**-7 * max|y|`` (bf16 output rounding is 2**-9
  relative; accumulation orders differ).
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardspeed.inference.quantization import (
    QuantizedLinear,
    WeightQuantConfig,
    config_from_deepspeed,
    dequantize_weight,
    quantize_model,
    quantize_weight,
)
from shardspeed.inference.quantization.kernels import REFERENCE, unpack_int4
from shardspeed.inference.quantization.qtensor import pack_int4

SCHEMES = [
    (8, None, True),
    (8, None, False),
    (8, 64, True),
    (4, 32, True),
    (4, 32, False),
    (4, 64, True),
    (4, 64, False),
    (4, 128, True),
    (4, 128, False),
]


def _weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier: its group gets a coarse scale
    w[5] = w[5].abs()  # an all-positive row: asymmetric range matters
    return w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("bits,group_size,symmetric", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_bound(bits, group_size, symmetric, dtype):
    w = _weight().to(dtype)
    qw = quantize_weight(w, bits, group_size, symmetric)
    gs = group_size or w.shape[1]
    deq = dequantize_weight(qw)
    step = qw.scales.repeat_interleave(gs, dim=1)  # (N, K): each element's scale
    err = (w.float() - deq).abs()
    assert (err <= step / 2 + 1e-6).all(), (err - step / 2).max()
    assert qw.scales.shape == (96, 256 // gs)
    if bits == 8:
        assert qw.qdata.dtype == torch.int8 and qw.qdata.shape == (96, 256)
    else:
        assert qw.qdata.dtype == torch.uint8 and qw.qdata.shape == (96, 128)
    assert (qw.zeros is None) == symmetric


def test_int4_packing_round_trip():
    q = torch.randint(0, 16, (5, 64), dtype=torch.int32)
    packed = pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed[0, 0], (q[0, 0] | (q[0, 1] << 4)).to(torch.uint8))


def test_zero_stays_exact_asymmetric():
    w = _weight()
    w[:, :32] = 0.0
    deq = dequantize_weight(quantize_weight(w, 4, 32, False))
    assert torch.equal(deq[:, :32], torch.zeros(96, 32))


def _weight_from_bf16_tables(qw, layer: QuantizedLinear) -> torch.Tensor:
    """fp32 ``(N, K)`` weight from the integers and the layer's own (bf16) scale tables."""
    n, k = qw.shape
    q = qw.int_values().float().view(n, k // qw.group_size, qw.group_size)  # (N, G, gs)
    if qw.bits == 8:  # scales (N,)
        return (q * layer.scales.float()[:, None, None]).view(n, k)
    table = layer.scales.float().transpose(0, 1)  # (G, N, 2) -> (N, G, 2)
    return ((q - 8) * table[..., :1] + table[..., 1:]).view(n, k)  # torch's int4 formula


@pytest.mark.parametrize("bits,group_size,symmetric", SCHEMES)
def test_kernel_matches_reference(bits, group_size, symmetric):
    w, bias = _weight(), torch.randn(96) * 0.1
    x = torch.randn(2, 5, 256)
    base = WeightQuantConfig(bits=bits, group_size=group_size, symmetric=symmetric)
    ref = QuantizedLinear.from_weight(w, bias, base.with_overrides(kernel="reference"))
    assert ref.kernel is REFERENCE
    # the reference path is exactly F.linear with the dequantized weight
    deq = dequantize_weight(quantize_weight(w, bits, base.effective_group_size, symmetric))
    torch.testing.assert_close(ref(x), torch.nn.functional.linear(x, deq, bias))
    auto = QuantizedLinear.from_weight(w, bias, base)
    if bits == 8 and (group_size is not None or not symmetric):
        # torch's int8 kernel is per-channel only; asymmetric int8 needs fp32 compute there
        assert auto.kernel is REFERENCE and auto.compute_dtype is None
        if group_size is not None:
            return
    else:
        assert auto.kernel.name in ("torch_int8", "torch_int4_cpu"), auto.kernel.name
        assert auto.compute_dtype == torch.bfloat16
        # the oracle sees what the kernel holds: bf16 input and bf16 scale(/zero) tables
        qw = quantize_weight(w, bits, base.effective_group_size, symmetric)
        w_table = _weight_from_bf16_tables(qw, auto)
        y_ref = torch.nn.functional.linear(x.bfloat16().float(), w_table, bias)
        assert _rel(auto(x), y_ref) <= 2**-7
    exact = QuantizedLinear.from_weight(w, bias, base.with_overrides(compute_dtype="float32"))
    assert exact.kernel.name in ("torch_int8", "torch_int4_cpu"), exact.kernel.name
    assert _rel(exact(x), ref(x)) <= 1e-5
    # the kernel's own layout dequantizes (identity trick) to the reference weight
    torch.testing.assert_close(exact.dequantized_weight(), deq, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "bits,group_size,limit", [(8, None, 0.27), (4, 128, 0.15), (4, 64, 0.15), (4, 32, 0.19)]
)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_bytes_ratio(bits, group_size, limit, symmetric, kernel):
    w = _weight(n=256, k=512)
    cfg = WeightQuantConfig(bits=bits, group_size=group_size, symmetric=symmetric, kernel=kernel)
    layer = QuantizedLinear.from_weight(w, None, cfg)
    ratio = layer.weight_nbytes() / (w.numel() * 4)  # packed ints + scales + zero points
    assert ratio <= limit, (ratio, layer)


def test_quantize_model_swaps_and_matches_dequantized_copy():
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(50, 64))
    model.add_module("fc", torch.nn.Linear(64, 128))
    model.add_module("act", torch.nn.GELU())
    model.add_module("proj", torch.nn.Linear(128, 64))
    model.add_module("lm_head", torch.nn.Linear(64, 50, bias=False))
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 50, (3, 7))
    expected_weights = {
        name: dequantize_weight(quantize_weight(getattr(model, name).weight, 4, 32, False))
        for name in ("fc", "proj")
    }
    cfg = WeightQuantConfig(bits=4, group_size=32, symmetric=False, kernel="reference")
    out = quantize_model(model, cfg)
    assert out is model
    assert isinstance(model.fc, QuantizedLinear) and isinstance(model.proj, QuantizedLinear)
    assert isinstance(model.lm_head, torch.nn.Linear)  # skipped by default
    assert isinstance(model.embed, torch.nn.Embedding)
    for name, w in expected_weights.items():
        getattr(plain, name).weight.data.copy_(w)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), atol=1e-6, rtol=1e-5)


def test_module_filters():
    model = torch.nn.ModuleDict(
        {
            "attn": torch.nn.ModuleDict({"q_proj": torch.nn.Linear(32, 32)}),
            "mlp": torch.nn.ModuleDict({"up": torch.nn.Linear(32, 64), "gate": torch.nn.Linear(32, 4)}),
        }
    )  # fmt: skip
    quantize_model(model, WeightQuantConfig(modules=("mlp",)))
    assert isinstance(model["mlp"]["up"], QuantizedLinear)
    assert not isinstance(model["mlp"]["gate"], QuantizedLinear)  # router: default skip
    assert not isinstance(model["attn"]["q_proj"], QuantizedLinear)  # not in modules
    quantize_model(model, WeightQuantConfig(skip_modules=()))
    assert isinstance(model["attn"]["q_proj"], QuantizedLinear)
    assert isinstance(model["mlp"]["gate"], QuantizedLinear)


def test_gpt2_conv1d():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=96, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(cfg).eval()
    plain = GPT2LMHeadModel(cfg).eval()
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        full = model(ids).logits
    conv_names = [n for n, m in plain.named_modules() if isinstance(m, Conv1D)]
    for name in conv_names:  # the oracle: Conv1D weights (in, out) set to their dequantized value
        conv = plain.get_submodule(name)
        deq = dequantize_weight(quantize_weight(conv.weight.t(), 8, None, True))  # (out, in)
        conv.weight.data.copy_(deq.t())
    quantize_model(model, WeightQuantConfig(bits=8, kernel="reference"))
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == len(conv_names) == 8
    with torch.no_grad():
        got = model(ids).logits
        torch.testing.assert_close(got, plain(ids).logits, atol=1e-5, rtol=1e-5)
    assert _rel(got, full) < 0.05  # int8 stays close to fp32 on random weights too


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=3), "bits=3"),
        (dict(bits=4, group_size=48), "group_size=48"),
        (dict(bits=8, group_size=0), "group_size=0"),
        (dict(kernel="fast"), "kernel='fast'"),
        (dict(compute_dtype="int8"), "compute_dtype='int8'"),
        (dict(bits=8, group_size=64, kernel="torch"), "per-output-channel only"),
    ],
)
def test_bad_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightQuantConfig(**kwargs)


def test_bad_config_types_and_names():
    with pytest.raises(TypeError, match="skip_modules"):
        WeightQuantConfig(skip_modules="lm_head")
    with pytest.raises(ValueError, match="int5"):
        WeightQuantConfig.parse("int5")
    with pytest.raises(ValueError, match="unknown part"):
        WeightQuantConfig.parse("int4-fast")
    with pytest.raises(ValueError, match="unknown WeightQuantConfig key"):
        WeightQuantConfig.parse({"bitz": 8})
    with pytest.raises(TypeError, match="quantization=3"):
        WeightQuantConfig.parse(3)
    assert WeightQuantConfig.parse("int4-g64-asym") == WeightQuantConfig(
        bits=4, group_size=64, symmetric=False
    )
    model = torch.nn.Sequential(torch.nn.Linear(48, 8))
    with pytest.raises(ValueError, match="layer '0'.*group_size=32"):
        quantize_model(model, WeightQuantConfig(bits=4, group_size=32))


def test_config_from_deepspeed_quant_block():
    cfg = config_from_deepspeed(
        {"enabled": True, "weight": {"num_bits": 4, "q_groups": 8, "q_type": "asymmetric"}}
    )
    assert (cfg.bits, cfg.effective_group_size, cfg.symmetric) == (4, 128, False)
    cfg = config_from_deepspeed({"quant": {"weight": {"num_bits": 8}, "qkv": {"enabled": False}}})
    assert cfg.bits == 8 and cfg.symmetric and "*q_proj" in cfg.skip_modules
    assert not cfg.selects("model.layers.0.self_attn.q_proj")
    assert cfg.selects("model.layers.0.mlp.up_proj")
    assert config_from_deepspeed({"enabled": False}) is None
    assert config_from_deepspeed({"weight": {"enabled": False}}) is None
    with pytest.raises(ValueError, match="activation"):
        config_from_deepspeed({"activation": {"enabled": True, "num_bits": 8}})
    with pytest.raises(ValueError, match="q_type='nf4'"):
        config_from_deepspeed({"weight": {"q_type": "nf4"}})
    with pytest.raises(ValueError, match="num_bits=2"):
        config_from_deepspeed({"weight": {"num_bits": 2}})
    with pytest.raises(ValueError, match="q_groups=0"):
        config_from_deepspeed({"weight": {"q_groups": 0}})
    with pytest.raises(ValueError, match="unknown key"):
        config_from_deepspeed({"weights": {}})


def test_config_from_deepspeed_post_init_quant():
    block = {
        "weight_quantization": {
            "post_init_quant": {
                "fc": {"num_bits": 4, "group_size": 64, "group_dim": 1, "symmetric": False},
                "self_attn.q_proj": {"num_bits": 4, "group_size": 64, "group_dim": 1},
            }
        }
    }
    cfg = config_from_deepspeed(block)
    assert (cfg.bits, cfg.group_size, cfg.symmetric) == (4, 64, False)
    assert cfg.selects("decoder.layers.0.fc1") and cfg.selects("layers.1.self_attn.q_proj")
    assert not cfg.selects("layers.1.self_attn.k_proj")
    bad = {"post_init_quant": {"fc": {"num_bits": 4, "group_size": 64, "group_dim": 0}}}
    with pytest.raises(ValueError, match="group_dim=0"):
        config_from_deepspeed(bad)
    mixed = {"post_init_quant": {"fc": {"num_bits": 4}, "proj": {"num_bits": 8}}}
    with pytest.raises(ValueError, match="different settings"):
        config_from_deepspeed(mixed)
    with pytest.raises(ValueError, match="quantized_initialization"):
        config_from_deepspeed({"quantized_initialization": {"num_bits": 8}})


def _tiny_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path / "ckpt")
    return model


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_pipeline_quantization_matches_hf_quantized(tmp_path, scheme):
    """FastGen's fused qkv / gate_up rows quantize exactly like HF's separate layers."""
    from shardspeed.inference.serving.pipeline import pipeline

    torch.set_num_threads(1)
    hf = _tiny_llama(tmp_path)
    config = WeightQuantConfig.parse(scheme).with_overrides(kernel="reference")
    quantize_model(hf, config)
    prompts = [[5, 9, 17, 33, 2, 64], [7, 7, 8]]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, pad_token_id=0)
            refs.append(out[0, len(p) :].tolist())
    pipe = pipeline(tmp_path / "ckpt", quantization=config, block_size=4, num_blocks=64)
    layers = [m for m in pipe.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down per layer; lm_head kept
    got = [r.token_ids for r in pipe(prompts, max_new_tokens=8, ignore_eos=True)]
    assert got == refs


def test_pipeline_quantization_default_kernel_generates(tmp_path):
    from shardspeed.inference.serving.pipeline import pipeline

    torch.set_num_threads(1)
    _tiny_llama(tmp_path)
    pipe = pipeline(tmp_path / "ckpt", quantization="int4", block_size=4, num_blocks=64)
    kernels = {m.kernel.name for m in pipe.engine.model.modules() if isinstance(m, QuantizedLinear)}
    assert kernels == {"torch_int4_cpu"}
    (resp,) = pipe([[5, 9, 17]], max_new_tokens=6, ignore_eos=True)
    assert resp.generated_length == 6
    with pytest.raises(ValueError, match="int9"):
        pipeline(tmp_path / "ckpt", quantization="int9")


def test_init_inference_int8_dtype_quantizes_weights_and_computes_in_fp16():
    import shardspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(50, 64))
    model.add_module("fc", torch.nn.Linear(64, 128))
    model.add_module("act", torch.nn.GELU())
    model.add_module("proj", torch.nn.Linear(128, 64))
    model.add_module("lm_head", torch.nn.Linear(64, 50, bias=False))
    plain = copy.deepcopy(model).half()
    ids = torch.randint(0, 50, (3, 7))
    engine = shardspeed.init_inference(model, dtype=torch.int8, keep_module_on_host=True)
    fc = engine.module.fc
    assert isinstance(fc, QuantizedLinear) and fc.meta.bits == 8
    assert torch.int8 in {buf.dtype for buf in fc.buffers()}  # the weight is stored as int8
    for name in ("fc", "proj"):  # per output channel, symmetric: DeepSpeed's int8 grouping
        expected = dequantize_weight(
            quantize_weight(getattr(plain, name).weight.float(), 8, None, True)
        )
        plain_layer = getattr(plain, name)
        plain_layer.weight.data.copy_(expected.half())
    with torch.no_grad():
        out = engine(ids)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.float(), plain(ids).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bits", [8, 4])
def test_grid_weights_without_their_top_level_are_kept_exactly(bits: int) -> None:
    """Rows quantized to a grid whose largest level was pruned away (columns removed after
    the scale was fixed) still load exactly: the step is found from a lower level."""
    torch.manual_seed(bits)
    qmax = 2 ** (bits - 1) - 1
    q = torch.randint(-qmax + 1, qmax, (8, 65)).float()
    q[:, 0] = qmax  # every row's top level sits in column 0 ...
    q[4:, 1] = -qmax  # ... rows 4-7 keep theirs in column 1
    steps = torch.rand(8, 1) * 0.01 + 1e-3
    w = (q * steps)[:, 1:].contiguous()  # ... and pruning removes column 0
    w[:3, 3] = (qmax - 2) * steps[:3, 0]  # rows 0-2: largest remaining level qmax - 2
    w[3] = 0.0  # an all-zero row too
    got = dequantize_weight(quantize_weight(w, bits, None, True))
    # exact up to the rounding of the recovered step (absmax / qmax vs the original step)
    torch.testing.assert_close(got, w, rtol=1e-6, atol=0.0)
    plain = w - dequantize_weight(quantize_weight(w.bfloat16().float(), bits, None, True))
    assert plain.abs().max() > 1e-5  # (the check can fail: an off-grid copy is requantized)
