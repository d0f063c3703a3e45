"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 block with a routed mixture of experts.

* routed experts of width ``moe_intermediate_size``; softmax (fp32) -> top-k, the k
  weights renormalised only when ``norm_topk_prob``;
* Qwen2-MoE adds a shared expert (``shared_expert_intermediate_size``) scaled by
  ``sigmoid(shared_expert_gate(x))`` (the DeepSeek-style shared + routed layout);
* layer ``i`` is routed when ``i`` is not in ``mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``; the others keep a dense MLP of
  ``intermediate_size``.

Expert weights load from transformers 5's fused ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]`` or per-expert
``mlp.experts.{e}.gate_proj/up_proj/down_proj``.
"""

from __future__ import annotations

from typing import Any

from shardspeed.inference.fastgen.models.config_check import Refusal, validate_config
from shardspeed.inference.fastgen.models.decoder import DecoderModel, DecoderSpec
from shardspeed.inference.fastgen.models.llama import BASE_KEYS, base_spec, qwen_windows
from shardspeed.inference.fastgen.models.registry import register_model

_MOE_KEYS = (
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types",
)  # fmt: skip
_KEYS = {
    "qwen2_moe": BASE_KEYS + _MOE_KEYS + ("qkv_bias", "shared_expert_intermediate_size"),
    "qwen3_moe": BASE_KEYS + _MOE_KEYS + ("attention_bias",),
}


def _moe_layers(model_type: str, config: dict[str, Any], num_experts: int) -> list[bool]:
    n = config["num_hidden_layers"]
    step = config.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{model_type} config decoder_sparse_step={step!r} must be an int >= 1.")
    dense = set(config.get("mlp_only_layers") or [])
    return [num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)]


@register_model("qwen2_moe", "qwen3_moe")
class QwenMoEModel(DecoderModel):
    """Qwen2-MoE (qkv bias, shared expert) and Qwen3-MoE (q/k RMSNorm) sparse decoders."""

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS[model_type], []

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        model_type = config.get("model_type", "qwen2_moe")
        validate_config(model_type, config, *cls.config_fields(model_type))
        num_experts = config.get("num_experts", config.get("num_local_experts")) or 0
        top_k = config["num_experts_per_tok"]
        if num_experts and not 1 <= top_k <= num_experts:
            raise ValueError(
                f"{model_type} config num_experts_per_tok={top_k} must be in [1, num_experts="
                f"{num_experts}]."
            )
        moe = dict(
            num_experts=num_experts, top_k=top_k,
            moe_intermediate=config["moe_intermediate_size"],
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            moe_layers=_moe_layers(model_type, config, num_experts),
            layer_windows=qwen_windows(model_type, config),
        )  # fmt: skip
        if model_type == "qwen2_moe":
            return base_spec(
                model_type, config, qkv_bias=bool(config.get("qkv_bias", True)),
                shared_expert_intermediate=config.get("shared_expert_intermediate_size") or 0,
                shared_expert_gate=True, **moe,
            )  # fmt: skip
        bias = bool(config.get("attention_bias", False))
        return base_spec(model_type, config, qkv_bias=bias, o_bias=bias, qk_norm=True, **moe)
