"""Phi-3: Llama block with checkpoint-fused ``qkv_proj`` / ``gate_up_proj``, optional partial
rotary, longrope scaling and a sliding window on every layer."""

from __future__ import annotations

from typing import Any

from shardspeed.inference.fastgen.models.config_check import Refusal, validate_config
from shardspeed.inference.fastgen.models.decoder import (
    SLIDING,
    DecoderModel,
    DecoderSpec,
    layer_windows,
)
from shardspeed.inference.fastgen.models.llama import BASE_KEYS, base_spec
from shardspeed.inference.fastgen.models.registry import register_model

_KEYS = BASE_KEYS + ("original_max_position_embeddings", "sliding_window")


@register_model("phi3")
class Phi3Model(DecoderModel):
    """Phi-3 (mini/medium) decoder; no biases."""

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, []

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        validate_config("phi3", config, *cls.config_fields("phi3"))
        n = config["num_hidden_layers"]
        windows = layer_windows("phi3", config, config.get("sliding_window"), [SLIDING] * n)
        return base_spec("phi3", config, layer_windows=windows)
