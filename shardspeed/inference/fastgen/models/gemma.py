"""Gemma: Llama block with a GeGLU MLP, ``(1 + w)`` RMSNorm and embeddings scaled by
``sqrt(hidden_size)``; the LM head is tied to the embeddings."""

from __future__ import annotations

from typing import Any

from shardspeed.inference.fastgen.models.config_check import Refusal, falsy, validate_config
from shardspeed.inference.fastgen.models.decoder import DecoderModel, DecoderSpec
from shardspeed.inference.fastgen.models.llama import BASE_KEYS, base_spec
from shardspeed.inference.fastgen.models.registry import register_model

_KEYS = BASE_KEYS + ("attention_bias",)


@register_model("gemma")
class GemmaModel(DecoderModel):
    """Gemma (v1) decoder."""

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, [falsy("use_bidirectional_attention", "bidirectional attention")]

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        validate_config("gemma", config, *cls.config_fields("gemma"))
        act = config.get("hidden_act", "gelu_pytorch_tanh")
        if act == "gelu":  # HF's GemmaConfig maps the legacy value to the tanh approximation
            act = "gelu_pytorch_tanh"
        bias = bool(config.get("attention_bias", False))
        return base_spec(
            "gemma", config, act=act, norm_offset=1.0, qkv_bias=bias, o_bias=bias,
            embed_scale=config["hidden_size"] ** 0.5,
            tied=bool(config.get("tie_word_embeddings", True)),
        )  # fmt: skip
