"""Gemma 2: Gemma plus attention/final logit soft-capping, alternating sliding-window
layers, sandwich norms (post-attention, pre/post-MLP) and ``query_pre_attn_scalar``."""

from __future__ import annotations

from typing import Any

from shardspeed.inference.fastgen.models.config_check import Refusal, falsy, validate_config
from shardspeed.inference.fastgen.models.decoder import (
    FULL,
    SLIDING,
    DecoderModel,
    DecoderSpec,
    layer_windows,
)
from shardspeed.inference.fastgen.models.llama import BASE_KEYS, base_spec
from shardspeed.inference.fastgen.models.registry import register_model

_KEYS = BASE_KEYS + (
    "attention_bias", "hidden_activation", "query_pre_attn_scalar", "sliding_window",
    "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
)  # fmt: skip


def _positive_or_none(model_type: str, config: dict[str, Any], key: str) -> float | None:
    value = config.get(key)
    if value is not None and not float(value) > 0:
        raise ValueError(f"{model_type} config {key}={value!r} must be > 0 or null.")
    return None if value is None else float(value)


@register_model("gemma2")
class Gemma2Model(DecoderModel):
    """Gemma 2 decoder (even layers slide by default)."""

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, [falsy("use_bidirectional_attention", "bidirectional attention")]

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        validate_config("gemma2", config, *cls.config_fields("gemma2"))
        n = config["num_hidden_layers"]
        default = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
        windows = layer_windows("gemma2", config, config.get("sliding_window"), default)
        bias = bool(config.get("attention_bias", False))
        scalar = config.get("query_pre_attn_scalar")
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        return base_spec(
            "gemma2", config, act=act, act_field="hidden_activation", norm_offset=1.0,
            qkv_bias=bias, o_bias=bias, sandwich_norm=True, layer_windows=windows,
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_softcap=_positive_or_none("gemma2", config, "attn_logit_softcapping"),
            final_softcap=_positive_or_none("gemma2", config, "final_logit_softcapping"),
            embed_scale=config["hidden_size"] ** 0.5,
            tied=bool(config.get("tie_word_embeddings", True)),
        )  # fmt: skip
