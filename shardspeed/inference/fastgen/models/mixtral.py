"""Mixtral: the Mistral block with a top-k routed mixture of SwiGLU experts.

The experts are all local on one process; with ``expert_parallel=E`` each rank holds
``num_local_experts / E`` of them (:mod:`shardspeed.inference.fastgen.expert_parallel`).

Routing follows HF: softmax over the router logits in fp32, top-k, renormalise
the k weights to sum to 1. Expert weights load from either checkpoint layout:
``block_sparse_moe.experts.{e}.w1/w2/w3`` or transformers 5's fused
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``.
"""

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

_KEYS = BASE_KEYS + ("sliding_window", "num_local_experts", "num_experts_per_tok")


@register_model("mixtral")
class MixtralModel(DecoderModel):
    """Mixtral sparse-MoE decoder."""

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, []

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        validate_config("mixtral", config, *cls.config_fields("mixtral"))
        n = config["num_hidden_layers"]
        num_experts, top_k = config["num_local_experts"], config["num_experts_per_tok"]
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"mixtral config num_experts_per_tok={top_k} must be in [1, num_local_experts="
                f"{num_experts}]."
            )
        windows = layer_windows("mixtral", config, config.get("sliding_window"), [SLIDING] * n)
        return base_spec(
            "mixtral", config, layer_windows=windows, num_experts=num_experts, top_k=top_k
        )
