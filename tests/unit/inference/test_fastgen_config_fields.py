"""Config honesty: every HF config field of a supported family is honoured or refused.

* Each family's full HF config (every key transformers writes) is classified:
  honoured by the ragged forward, refused for unsupported values, or known not
  to change the math (dropout, init, bookkeeping).
* Each refused value raises ``ValueError`` naming the field and the value.
* Math-changing fields that are implemented give HF's greedy tokens (GPT-2
  variants here; the Llama-like fields in test_fastgen_families.py).
"""

from __future__ import annotations

import pytest
import torch
from fastgen_helpers import VOCAB, hf_greedy, make_prompts

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.models import get_model_class, supported_model_types
from shardspeed.inference.fastgen.models.config_check import unclassified_keys
from shardspeed.inference.fastgen.sampling_params import SamplingParams

HF_CONFIGS = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config", "phi3": "Phi3Config", "gemma": "GemmaConfig",
    "gemma2": "Gemma2Config", "mixtral": "MixtralConfig", "gpt2": "GPT2Config",
    "gpt_neox": "GPTNeoXConfig", "opt": "OPTConfig", "falcon": "FalconConfig",
}  # fmt: skip
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def _hf_config(model_type: str, **overrides) -> dict:
    import transformers

    return getattr(transformers, HF_CONFIGS[model_type])(**overrides).to_dict()


def _build_meta(config: dict):
    cls = get_model_class(config["model_type"])
    with torch.device("meta"):
        return cls.from_config(config)


FAMILIES = [m for m in HF_CONFIGS if m in supported_model_types()]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_hf_config_key_is_classified(model_type):
    config = _hf_config(model_type)
    cls = get_model_class(model_type)
    assert unclassified_keys(config, *cls.config_fields(model_type)) == []
    _build_meta(config)  # the default config itself is accepted


# (model_type, field, refused value, extra overrides)
REFUSED = [
    ("llama", "hidden_act", "bogus_act", {}),
    ("llama", "rope_parameters", {"rope_type": "bogus", "rope_theta": 1e4}, {}),
    ("llama", "rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}, {}),  # no factor
    ("llama", "rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                  "beta_fast": 3}, {}),  # key the type does not use
    ("llama", "quantization_config", {"quant_method": "gptq", "bits": 4}, {}),
    ("llama", "partial_rotary_factor", 1.5, {}),
    ("mistral", "layer_types", ["sliding_attention", "full_attention"], {}),
    ("mistral", "sliding_window", 0, {}),
    ("qwen2", "layer_types", ["chunked_attention", "full_attention"], {}),
    ("qwen3", "layer_types", ["full_attention"], {}),  # wrong length
    ("gemma", "use_bidirectional_attention", True, {}),
    ("gemma2", "hidden_activation", "bogus_act", {}),
    ("gemma2", "attn_logit_softcapping", -1.0, {}),
    ("gemma2", "use_bidirectional_attention", True, {}),
    ("mixtral", "num_experts_per_tok", 9, {}),
    ("gpt2", "activation_function", "bogus_act", {}),
    ("gpt2", "add_cross_attention", True, {}),
    ("gpt_neox", "hidden_act", "bogus_act", {}),
    ("gpt_neox", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                     "partial_rotary_factor": 0.0}, {}),
    ("opt", "activation_function", "bogus_act", {}),
    ("falcon", "alibi", True, {}),
    ("falcon", "parallel_attn", False, {"new_decoder_architecture": True}),
    ("falcon", "activation", "bogus_act", {}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "field", "value", "extra"),
    [r for r in REFUSED if r[0] in FAMILIES],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_value_raises_naming_the_field(model_type, field, value, extra):
    config = _hf_config(model_type)
    config.update(extra)
    config[field] = value
    with pytest.raises(ValueError) as err:
        _build_meta(config)
    message = str(err.value)
    shown = field if field != "rope_parameters" else "rope"
    assert shown in message, message


def test_shardspeed_gpt_config_is_classified():
    from shardspeed.models.gpt import GPTConfig

    config = {"model_type": "shardspeed_gpt", **GPTConfig().to_dict()}
    cls = get_model_class("shardspeed_gpt")
    assert unclassified_keys(config, *cls.config_fields("shardspeed_gpt")) == []


def test_unknown_key_warns_once(caplog):
    config = _hf_config("llama", **TINY)
    config["some_future_switch"] = True
    with caplog.at_level("WARNING"):
        _build_meta(config)
    assert "some_future_switch" in caplog.text


GPT2_VARIANTS = {
    "relu": dict(activation_function="relu"),
    "gelu_fast": dict(activation_function="gelu_fast"),
    "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True),
    "unscaled": dict(scale_attn_weights=False),
    "upcast": dict(reorder_and_upcast_attn=True),
    "eps_untied": dict(layer_norm_epsilon=1e-1, tie_word_embeddings=False),
}


@pytest.mark.parametrize(
    "name",
    [n if n in ("inverse_layer_idx", "unscaled") else pytest.param(n, marks=pytest.mark.slow)
     for n in GPT2_VARIANTS],
)  # fmt: skip
def test_gpt2_math_fields_match_hf(name):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=1,
        eos_token_id=1, initializer_range=0.1, **GPT2_VARIANTS[name],
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg).eval()
    prompts = make_prompts(4, 3, 30, seed=21)
    refs = hf_greedy(model, prompts, 16)
    engine = InferenceEngine.from_pretrained(model, block_size=4, num_blocks=128)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16))
    assert [o.output_token_ids for o in outs] == refs


@pytest.mark.parametrize(
    "act", ["gelu", pytest.param("gelu_new", marks=pytest.mark.slow), "relu",
            pytest.param("quick_gelu", marks=pytest.mark.slow)],
)  # fmt: skip
def test_llama_hidden_act_is_honoured(act):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **TINY, intermediate_size=96, num_key_value_heads=2, max_position_embeddings=128,
        hidden_act=act, initializer_range=0.1,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    prompts = make_prompts(4, 3, 30, seed=22)
    refs = hf_greedy(model, prompts, 16)
    engine = InferenceEngine.from_pretrained(model, block_size=4, num_blocks=128)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16))
    assert [o.output_token_ids for o in outs] == refs
