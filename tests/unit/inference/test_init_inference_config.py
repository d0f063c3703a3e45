"""``init_inference``'s config and single-process behaviour (tp_size 1).

Every DeepSpeed inference key is acted on or refused: the refusals are listed here one by
one, the accepted keys are exercised through ``init_inference`` (dtype, kernel injection,
token limits, checkpoint loading, config file + kwargs merge).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import shardspeed
from shardspeed.config.base import ConfigError
from shardspeed.inference.config import DeepSpeedInferenceConfig
from shardspeed.inference.engine import InferenceEngine
from shardspeed.inference.injection import FusedAttention

tf = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def make_llama(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA, pad_token_id=0, eos_token_id=1)).eval()


# ----------------------------------------------------------------- the config model
def test_defaults_follow_deepspeed() -> None:
    cfg = DeepSpeedInferenceConfig()
    assert cfg.dtype == torch.float16  # DeepSpeed's default
    assert (cfg.tp_size, cfg.max_out_tokens, cfg.min_out_tokens) == (1, 1024, 1)
    assert not cfg.replace_with_kernel_inject and not cfg.quant_enabled


@pytest.mark.parametrize(
    ("data", "field", "value"),
    [
        ({"tp": {"tp_size": 2}}, "tp_size", 2),
        ({"tensor_parallel": {"tp_size": 4, "enabled": False}}, "tp_size", 1),
        ({"mp_size": 2}, "tp_size", 2),  # deprecated spelling
        ({"kernel_inject": True}, "replace_with_kernel_inject", True),
        ({"max_tokens": 77}, "max_out_tokens", 77),
        ({"min_tokens": 3}, "min_out_tokens", 3),
        ({"dtype": "bf16"}, "dtype", torch.bfloat16),
        ({"dtype": "torch.float32"}, "dtype", torch.float32),
        ({"dtype": torch.half}, "dtype", torch.float16),
        ({"quant": {"enabled": True}}, "quant_enabled", True),
        ({"quant": {"enabled": False}}, "quant_enabled", False),
        ({"ckpt_config": {"checkpoint_dir": "d"}}, "checkpoint_source", "d"),
        ({"zero": {"stage": 0}}, "tp_size", 1),
    ],
)
def test_accepted_keys_and_aliases(data: dict[str, Any], field: str, value: Any) -> None:
    assert getattr(DeepSpeedInferenceConfig(**data), field) == value


REFUSED = [
    ("enable_cuda_graph", True, "torch.compile"),
    ("use_triton", True, "Triton"),
    ("triton_autotune", True, "Triton"),
    ("zero", {"stage": 3, "offload_param": {"device": "cpu"}}, "pipeline"),
    ("triangular_masking", False, "causal"),
    ("tm", False, "causal"),
    ("moe", {"type": "bogus"}, "MoE layer type"),
    ("ep_group", object(), "process group"),
    ("ep_mp_group", object(), "process group"),
    ("set_empty_params", True, "sliced"),
    ("save_mp_checkpoint_path", "/tmp/x", "sliced at load"),
    ("checkpoint_config", {"save_mp_checkpoint_path": "/tmp/x"}, "checkpoint_dir"),
    ("return_tuple", False, "return type"),
    ("training_mp_size", 2, "unsharded"),
    ("injection_policy_tuple", ("a",), "injection_policy"),
    ("config", {"hidden_size": 4}, "model.config"),
    ("args", {"hidden_size": 4}, "model.config"),
    ("transposed_mode", True, "layout"),
    ("dtype", "fp8", "Allowed"),
]


@pytest.mark.parametrize(("key", "value", "hint"), REFUSED, ids=[f"{k}={v}" for k, v, _ in REFUSED])
def test_refused_keys_say_why(key: str, value: Any, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        DeepSpeedInferenceConfig(**{key: value})
    message = str(info.value)
    assert hint in message
    canonical = {"tm": "triangular_masking", "args": "config"}.get(key, key)
    assert canonical in message


def test_unknown_key_suggests_the_spelling() -> None:
    with pytest.raises(ConfigError, match="did you mean 'replace_with_kernel_inject'"):
        DeepSpeedInferenceConfig(replace_with_kernal_inject=True)
    with pytest.raises(ConfigError, match="did you mean 'tp_size'"):
        DeepSpeedInferenceConfig(tensor_parallel={"tp_sise": 2})


def test_cross_field_errors() -> None:
    with pytest.raises(ConfigError, match="mp_size: conflicts with tensor_parallel.tp_size=4"):
        DeepSpeedInferenceConfig(mp_size=2, tensor_parallel={"tp_size": 4})
    with pytest.raises(ConfigError, match="alias of 'tensor_parallel'"):
        DeepSpeedInferenceConfig(tp={"tp_size": 2}, tensor_parallel={"tp_size": 2})
    with pytest.raises(ConfigError, match="min_out_tokens"):
        DeepSpeedInferenceConfig(max_out_tokens=8, min_out_tokens=9)
    with pytest.raises(ConfigError, match="max_out_tokens"):
        DeepSpeedInferenceConfig(max_out_tokens=0)
    with pytest.raises(ConfigError, match="injection_policy"):
        DeepSpeedInferenceConfig(injection_policy={"X": ("o",)}, replace_with_kernel_inject=True)


def test_tuning_knobs_warn_once_by_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        DeepSpeedInferenceConfig(tensor_parallel={"tp_grain_size": 32}, replace_method="layer")
    assert "tp_grain_size=32" in caplog.text and "replace_method" in caplog.text


# ----------------------------------------------------------------- init_inference at tp_size 1
def test_engine_wraps_and_matches_the_model() -> None:
    reference = make_llama()
    engine = shardspeed.init_inference(make_llama(), dtype=torch.float32, keep_module_on_host=True)
    assert isinstance(engine, InferenceEngine) and not engine.training
    ids = torch.randint(2, 64, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, reference(ids).logits, atol=0, rtol=0)
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(engine.generate(ids, **gen), reference.generate(ids, **gen))


def test_default_dtype_is_fp16_and_kwargs_override_config_file(tmp_path: Path) -> None:
    assert shardspeed.init_inference(make_llama()).module.lm_head.weight.dtype == torch.float16
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp16", "replace_with_kernel_inject": True}))
    engine = shardspeed.init_inference(make_llama(), config=str(path), dtype=torch.bfloat16)
    assert engine.module.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(engine.module.model.layers[0].self_attn, FusedAttention)
    with pytest.raises(ValueError, match="no such JSON file"):
        shardspeed.init_inference(make_llama(), config=str(tmp_path / "missing.json"))


def test_model_moves_to_the_accelerator_unless_kept_on_host() -> None:
    from shardspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    want = torch.device(accelerator.current_device_name() if accelerator.is_available() else "cpu")
    engine = shardspeed.init_inference(make_llama(), dtype="fp32")
    assert engine.module.lm_head.weight.device.type == want.type
    engine = shardspeed.init_inference(make_llama(), dtype="fp32", keep_module_on_host=True)
    assert engine.module.lm_head.weight.device.type == "cpu"


def test_token_limits_are_enforced() -> None:
    engine = shardspeed.init_inference(
        make_llama(), dtype="fp32", max_out_tokens=10, min_out_tokens=3, keep_module_on_host=True
    )
    ids = torch.randint(2, 64, (1, 6))
    engine.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # 10: fits
    with pytest.raises(ValueError, match="exceeds max_out_tokens=10"):
        engine.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="min_out_tokens=3"):
        engine(torch.randint(2, 64, (1, 8)))


@pytest.mark.parametrize("form", ["directory", "file", "descriptor", "descriptor_dict"])
def test_checkpoint_is_loaded(tmp_path: Path, form: str) -> None:
    reference = make_llama(seed=0)
    reference.save_pretrained(tmp_path / "hf")
    torch.save(reference.state_dict(), tmp_path / "model.pt")
    descriptor = {"type": "ds_model", "checkpoints": ["model.pt"], "version": 1.0}
    (tmp_path / "ckpt.json").write_text(json.dumps(descriptor))
    source: Any = {
        "directory": str(tmp_path / "hf"),
        "file": str(tmp_path / "model.pt"),
        "descriptor": str(tmp_path / "ckpt.json"),
        "descriptor_dict": descriptor,
    }[form]
    extra = {"base_dir": str(tmp_path)} if form == "descriptor_dict" else {}
    engine = shardspeed.init_inference(
        make_llama(seed=1), dtype="fp32", checkpoint=source, keep_module_on_host=True, **extra
    )
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(engine.module.state_dict()[name], tensor, atol=0, rtol=0)


def test_checkpoint_mismatch_is_refused(tmp_path: Path) -> None:
    state = make_llama().state_dict()
    torch.save({k: v for k, v in state.items() if "layers.1." not in k}, tmp_path / "part.pt")
    with pytest.raises(ValueError, match="lacks model tensors"):
        shardspeed.init_inference(make_llama(), checkpoint=str(tmp_path / "part.pt"))
    torch.save({**state, "extra.weight": torch.zeros(1)}, tmp_path / "more.pt")
    with pytest.raises(ValueError, match="extra.weight"):
        shardspeed.init_inference(make_llama(), checkpoint=str(tmp_path / "more.pt"))


def test_hostile_checkpoints_are_refused(tmp_path: Path) -> None:
    """Descriptors may not point outside their folder; broken files fail with their name."""
    (tmp_path / "ckpt").mkdir()
    torch.save(make_llama().state_dict(), tmp_path / "outside.pt")
    for name, files in {
        "climb.json": {"type": "ds_model", "checkpoints": ["../outside.pt"]},
        "absolute.json": {"type": "ds_model", "checkpoints": [str(tmp_path / "outside.pt")]},
        "index.json": {"weight_map": {"w": "../outside.pt"}},
    }.items():
        (tmp_path / "ckpt" / name).write_text(json.dumps(files))
        with pytest.raises(ValueError, match="outside its folder"):
            shardspeed.init_inference(make_llama(), checkpoint=str(tmp_path / "ckpt" / name))
    (tmp_path / "ckpt" / "gone.json").write_text(json.dumps({"checkpoints": ["gone.pt"]}))
    with pytest.raises(ValueError, match="does not exist"):
        shardspeed.init_inference(make_llama(), checkpoint=str(tmp_path / "ckpt" / "gone.json"))
    (tmp_path / "ckpt" / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        shardspeed.init_inference(make_llama(), checkpoint=str(tmp_path / "ckpt" / "bad.json"))
    whole = (tmp_path / "outside.pt").read_bytes()
    (tmp_path / "ckpt" / "cut.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="cut.pt.*truncated or corrupted"):
        shardspeed.init_inference(make_llama(), checkpoint=str(tmp_path / "ckpt" / "cut.pt"))
    (tmp_path / "ckpt" / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{junk}")
    with pytest.raises(ValueError, match="junk.safetensors"):
        shardspeed.init_inference(
            make_llama(), checkpoint=str(tmp_path / "ckpt" / "junk.safetensors")
        )
    torch.save([1, 2, 3], tmp_path / "ckpt" / "list.pt")
    with pytest.raises(ValueError, match="not a state dict"):
        shardspeed.init_inference(make_llama(), checkpoint=str(tmp_path / "ckpt" / "list.pt"))


def test_injection_policy_becomes_row_and_column_specs() -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from shardspeed.inference.tensor_parallel import partition_config_from_injection_policy

    specs = partition_config_from_injection_policy(
        make_llama(), {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}
    )["layer_specs"]
    rows = sorted(s["patterns"][0] for s in specs if s["partition_type"] == "row")
    assert len(specs) == 14 and len(rows) == 4 and "o_proj" in rows[-1]
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    specs = partition_config_from_injection_policy(gpt2, {GPT2Block: ("attn.c_proj", "mlp.c_proj")})
    c_attn = next(s for s in specs["layer_specs"] if "c_attn" in s["patterns"][0])
    assert c_attn["shape"] == [3, -1]  # fused [q | k | v] is cut per sub-parameter
    with pytest.raises(ValueError, match="name no linear layer"):
        partition_config_from_injection_policy(make_llama(), {LlamaDecoderLayer: ("o_proj_x",)})
    with pytest.raises(ValueError, match="no module of type"):
        partition_config_from_injection_policy(make_llama(), {GPT2Block: ("attn.c_proj",)})


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        shardspeed.init_inference("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a dict"):
        shardspeed.init_inference(make_llama(), config=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs at least 3 processes"):
        shardspeed.init_inference(make_llama(), tensor_parallel={"tp_size": 3})


@pytest.mark.parametrize("dtype", [torch.int8, "int8", "torch.int8"])
def test_int8_dtype_is_int8_weights_with_fp16_compute(dtype: Any) -> None:
    # DeepSpeed's documented switch for int8 inference: quantized weights, half compute
    config = DeepSpeedInferenceConfig(dtype=dtype)
    assert config.dtype == torch.float16
    assert config.quant_enabled and config.quant["weight"]["num_bits"] == 8
    kept = DeepSpeedInferenceConfig(dtype=dtype, quant={"weight": {"q_type": "asymmetric"}})
    assert kept.quant["weight"] == {"q_type": "asymmetric", "num_bits": 8}
    with pytest.raises(ConfigError, match="contradicts dtype=torch.int8"):
        DeepSpeedInferenceConfig(dtype=dtype, quant={"weight": {"num_bits": 4}})
