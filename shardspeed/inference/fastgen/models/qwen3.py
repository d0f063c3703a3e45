"""Qwen3: the Llama block plus per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from shardspeed.inference.fastgen.models.config_check import Refusal, validate_config
from shardspeed.inference.fastgen.models.decoder import DecoderModel, DecoderSpec
from shardspeed.inference.fastgen.models.llama import BASE_KEYS, base_spec, qwen_windows
from shardspeed.inference.fastgen.models.registry import register_model

_KEYS = BASE_KEYS + (
    "attention_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
)  # fmt: skip


@register_model("qwen3")
class Qwen3Model(DecoderModel):
    """Qwen3 dense decoder (``self_attn.q_norm`` / ``k_norm`` over ``head_dim``)."""

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, []

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        validate_config("qwen3", config, *cls.config_fields("qwen3"))
        bias = bool(config.get("attention_bias", False))
        return base_spec(
            "qwen3", config, qkv_bias=bias, o_bias=bias, qk_norm=True,
            layer_windows=qwen_windows("qwen3", config),
        )  # fmt: skip
