"""Llama 2/3, Mistral and Qwen2: RMSNorm, RoPE, GQA, SwiGLU (ragged forward).

Weights are copied from HF names (``model.layers.{i}.self_attn.q_proj.weight``
...) into fused ``qkv_proj`` and ``gate_up_proj`` matrices. Qwen2 adds a bias to
q/k/v; ``attention_bias`` / ``mlp_bias`` configs are honoured; tied embeddings
share ``embed_tokens.weight`` with the LM head.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardspeed.inference.fastgen.attention import paged_attention
from shardspeed.inference.fastgen.models.base import RaggedModel, WeightTarget
from shardspeed.inference.fastgen.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    rope_parameters,
)
from shardspeed.inference.fastgen.models.registry import register_model
from shardspeed.utils.logging import warning_once

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class LlamaLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = head_dim
        eps = cfg.get("rms_norm_eps", 1e-6)
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.split = [q_size, kv_size, kv_size]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        mlp_bias = bool(cfg.get("mlp_bias", False))
        self.intermediate = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: RaggedBatch,
        kv_cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        n = x.shape[0]  # x: [N, hidden]
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split(self.split, dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)  # [N, H, D]
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)  # [N, H_kv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [N, H_kv, D]
        o = paged_attention(q, k, v, kv_cache, layer, batch.slot_mapping, batch.attn)  # [N, H, D]
        x = x + self.o_proj(o.reshape(n, -1))  # [N, hidden]
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


@register_model("llama", "mistral", "qwen2")
class LlamaModel(RaggedModel):
    """Llama-family decoder with fused QKV and gate/up projections."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.model_type = cfg.get("model_type", "llama")
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg.get("max_position_embeddings")
        self.eos_token_ids = _eos_list(cfg.get("eos_token_id"))
        sliding = cfg.get("sliding_window")
        use_sliding = cfg.get("use_sliding_window", self.model_type == "mistral")
        if sliding and use_sliding and (self.max_positions or 0) > sliding:
            warning_once(
                f"{self.model_type}: sliding-window attention is not implemented; "
                f"limiting max_seq_len to sliding_window={sliding} so results stay exact."
            )
            self.max_positions = sliding
        qkv_bias = self.model_type == "qwen2" or bool(cfg.get("attention_bias", False))
        o_bias = self.model_type != "qwen2" and bool(cfg.get("attention_bias", False))
        self.embed_tokens = nn.Embedding(self.vocab_size, cfg["hidden_size"])
        self.layers = nn.ModuleList(
            [LlamaLayer(cfg, self.head_dim, qkv_bias, o_bias) for _ in range(self.num_layers)]
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.rotary = RotaryEmbedding(self.head_dim, rope_parameters(cfg), self.max_positions)
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = nn.Linear(cfg["hidden_size"], self.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LlamaModel:
        return cls(config)

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # [N, hidden]
        cos, sin = self.rotary(batch.positions, x.dtype)  # [N, D] each
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, kv_cache, i)
        x = x[batch.logits_indices]  # [M, hidden]: only rows that need logits
        return self.lm_head(self.norm(x))  # [M, vocab]

    _LAYER_RE = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight"):
            return [(name, tensor, None, False)]
        if name == "lm_head.weight":
            return [] if self.tied else [(name, tensor, None, False)]
        if name.endswith("layernorm.weight"):
            return [(name, tensor, None, False)]
        m = self._LAYER_RE.match(name)
        if m is None:
            return [] if "rotary_emb" in name else None
        idx, _, proj, kind = m.groups()
        prefix = f"layers.{idx}."
        layer = self.layers[int(idx)]
        q, kv = layer.split[0], layer.split[1]
        rows = {
            "q_proj": ("qkv_proj", slice(0, q)),
            "k_proj": ("qkv_proj", slice(q, q + kv)),
            "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
            "o_proj": ("o_proj", None),
            "gate_proj": ("gate_up_proj", slice(0, layer.intermediate)),
            "up_proj": ("gate_up_proj", slice(layer.intermediate, 2 * layer.intermediate)),
            "down_proj": ("down_proj", None),
        }
        if proj not in rows:
            return None
        target, sl = rows[proj]
        return [(f"{prefix}{target}.{kind}", tensor, sl, False)]
