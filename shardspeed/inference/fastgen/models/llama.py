"""Llama 2/3, Mistral and Qwen2: RMSNorm, RoPE, GQA, gated MLP (ragged forward).

Weights are copied from HF names (``model.layers.{i}.self_attn.q_proj.weight``
...) into fused ``qkv_proj`` and ``gate_up_proj`` matrices (see
:mod:`~shardspeed.inference.fastgen.models.decoder`). Qwen2 always has a q/k/v
bias; Mistral and Qwen2 honour ``sliding_window`` (Qwen2 per layer from
``layer_types`` / ``use_sliding_window`` + ``max_window_layers``).
"""

from __future__ import annotations

from typing import Any

from shardspeed.inference.fastgen.models.config_check import Refusal, validate_config
from shardspeed.inference.fastgen.models.decoder import (
    FULL,
    SLIDING,
    DecoderModel,
    DecoderSpec,
    eos_list,
    layer_windows,
)
from shardspeed.inference.fastgen.models.registry import register_model
from shardspeed.inference.fastgen.models.rope import rope_spec

# keys every Llama-like config uses and the decoder honours
BASE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "partial_rotary_factor", "eos_token_id",
)  # fmt: skip
_FAMILY_KEYS = {
    "llama": ("attention_bias", "mlp_bias"),
    "mistral": ("sliding_window",),
    "qwen2": ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
}


def base_spec(model_type: str, config: dict[str, Any], **overrides: Any) -> DecoderSpec:
    """The :class:`DecoderSpec` fields every Llama-like config defines."""
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=config["vocab_size"],
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        eps=float(config.get("rms_norm_eps", 1e-6)),
        act=config.get("hidden_act", "silu"),
        rope=rope_spec(config, head_dim, model_type),
        max_positions=config.get("max_position_embeddings"),
        eos_token_ids=eos_list(config.get("eos_token_id")),
        tied=bool(config.get("tie_word_embeddings", False)),
    )
    fields.update(overrides)
    return DecoderSpec(**fields)


def qwen_windows(model_type: str, config: dict[str, Any]) -> list[int | None]:
    """Qwen2/3: sliding layers are those at index >= ``max_window_layers`` when enabled."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    n = config["num_hidden_layers"]
    first = config.get("max_window_layers", n)
    default = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    return layer_windows(model_type, config, window, default)


@register_model("llama", "mistral", "qwen2")
class LlamaModel(DecoderModel):
    """Llama-family decoder with fused QKV and gate/up projections."""

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        refusals = []
        if model_type == "mistral":  # HF Mistral ignores layer_types; Ministral honours them
            refusals.append(
                Refusal("layer_types", lambda v: v is None, "unset", "use model_type 'ministral'")
            )
        return BASE_KEYS + _FAMILY_KEYS[model_type], refusals

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        model_type = config.get("model_type", "llama")
        validate_config(model_type, config, *cls.config_fields(model_type))
        n = config["num_hidden_layers"]
        if model_type == "llama":
            bias = bool(config.get("attention_bias", False))
            return base_spec(
                model_type, config, qkv_bias=bias, o_bias=bias,
                mlp_bias=bool(config.get("mlp_bias", False)),
            )  # fmt: skip
        if model_type == "mistral":
            window = config.get("sliding_window")
            return base_spec(
                model_type, config, layer_windows=layer_windows(model_type, config, window, [SLIDING] * n)
            )  # fmt: skip
        return base_spec(
            model_type, config, qkv_bias=True, layer_windows=qwen_windows(model_type, config)
        )
