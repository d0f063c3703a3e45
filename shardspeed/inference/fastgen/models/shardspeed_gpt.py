"""Our demo GPT (:class:`shardspeed.models.gpt.GPT`) served by the ragged GPT decoder."""

from __future__ import annotations

from typing import Any

from shardspeed.inference.fastgen.models.config_check import Refusal, validate_config
from shardspeed.inference.fastgen.models.gpt2 import GPTModel, GPTShape
from shardspeed.inference.fastgen.models.registry import register_model
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD, TensorShard


@register_model("shardspeed_gpt")
class ShardSpeedGPTModel(GPTModel):
    """Same block as GPT-2; weights are ``nn.Linear`` (no transpose), GELU is tanh."""

    conv1d_weights = False

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias"), []

    @classmethod
    def from_config(
        cls, config: dict[str, Any], shard: TensorShard = NO_SHARD
    ) -> ShardSpeedGPTModel:
        validate_config("shardspeed_gpt", config, *cls.config_fields("shardspeed_gpt"))
        hidden = config["n_embd"]
        shape = GPTShape(
            vocab_size=config["vocab_size"],
            max_positions=config["block_size"],
            hidden=hidden,
            num_layers=config["n_layer"],
            num_heads=config["n_head"],
            inner=4 * hidden,
            eps=1e-5,
            bias=bool(config.get("bias", True)),
            activation="gelu_tanh",
            eos_token_ids=[],
        )
        return cls(shape, model_type="shardspeed_gpt", shard=shard)
