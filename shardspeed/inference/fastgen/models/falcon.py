"""Falcon (RoPE variants): parallel attention/MLP, multi-query or grouped KV.

The checkpoint's fused ``query_key_value`` is loaded as-is and split after the
matmul, by layout:

* ``new_decoder_architecture`` (40B/180B): per KV group ``[q_0 .. q_{r-1}, k, v]``,
  ``r = num_heads / num_kv_heads``;
* ``multi_query`` (7B): ``[q_0 .. q_{H-1}, k, v]``, one KV head;
* neither: per head ``[q, k, v]``.

Blocks: ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))`` (two norms, new architecture),
``x + attn(ln(x)) + mlp(ln(x))`` (``parallel_attn``), or sequential pre-norm.
ALiBi Falcon checkpoints are refused.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.attention import paged_attention
from shardspeed.inference.fastgen.models.base import RaggedModel, WeightTarget
from shardspeed.inference.fastgen.models.config_check import Refusal, falsy, validate_config
from shardspeed.inference.fastgen.models.decoder import eos_list
from shardspeed.inference.fastgen.models.layers import activation
from shardspeed.inference.fastgen.models.registry import register_model
from shardspeed.inference.fastgen.models.rope import (
    RotaryEmbedding,
    apply_rope,
    forward_seq_lens,
    rope_spec,
)

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch

_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "n_head", "n_layer",
    "num_ln_in_parallel_attn", "layer_norm_epsilon", "num_kv_heads", "new_decoder_architecture",
    "multi_query", "parallel_attn", "bias", "max_position_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "ffn_hidden_size", "activation", "tie_word_embeddings",
    "eos_token_id",
)  # fmt: skip


def _normalise(cfg: dict[str, Any]) -> dict[str, Any]:
    """Resolve old key names and HF's derived defaults once."""
    cfg = dict(cfg)
    cfg["num_attention_heads"] = cfg.get("num_attention_heads") or cfg["n_head"]
    cfg["num_hidden_layers"] = cfg.get("num_hidden_layers") or cfg["n_layer"]
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    if new_arch:
        cfg["num_kv_heads"] = cfg.get("num_kv_heads") or cfg["num_attention_heads"]
        cfg["num_ln_in_parallel_attn"] = cfg.get("num_ln_in_parallel_attn") or 2
    elif cfg.get("multi_query", True):
        cfg["num_kv_heads"] = 1
    else:
        cfg["num_kv_heads"] = cfg["num_attention_heads"]
    cfg["ffn_hidden_size"] = cfg.get("ffn_hidden_size") or 4 * cfg["hidden_size"]
    return cfg


class FalconLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, eps, bias = cfg["hidden_size"], cfg.get("layer_norm_epsilon", 1e-5), cfg["bias"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_kv_heads"]
        self.head_dim = hidden // self.num_heads
        self.new_arch = bool(cfg.get("new_decoder_architecture", False))
        self.multi_query = bool(cfg.get("multi_query", True))
        self.parallel = bool(cfg.get("parallel_attn", True))
        self.two_norms = self.new_arch and cfg["num_ln_in_parallel_attn"] == 2
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(hidden, qkv_out, bias=bias)
        self.dense = nn.Linear(hidden, hidden, bias=bias)
        self.dense_h_to_4h = nn.Linear(hidden, cfg["ffn_hidden_size"], bias=bias)
        self.dense_4h_to_h = nn.Linear(cfg["ffn_hidden_size"], hidden, bias=bias)
        self.act = activation(cfg.get("activation", "gelu"), "activation")
        if self.two_norms:
            self.ln_attn = nn.LayerNorm(hidden, eps=eps)
            self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
            if not self.parallel:
                self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, h, h_kv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.new_arch:
            g = qkv.view(n, h_kv, h // h_kv + 2, d)  # [N, H_kv, r + 2, D]
            return g[:, :, :-2].reshape(n, h, d), g[:, :, -2], g[:, :, -1]
        if self.multi_query:
            g = qkv.view(n, h + 2, d)  # [N, H + 2, D]
            return g[:, :h], g[:, h : h + 1], g[:, h + 1 :]
        g = qkv.view(n, h, 3, d)  # [N, H, 3, D]
        return g[:, :, 0], g[:, :, 1], g[:, :, 2]

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))

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
        h_attn = self.ln_attn(x) if self.two_norms else self.input_layernorm(x)
        q, k, v = self._split_qkv(self.query_key_value(h_attn))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(q, k, v, kv_cache, layer, batch.slot_mapping, batch.attn)
        a = self.dense(o.reshape(n, -1))  # [N, hidden]
        if self.two_norms:
            return x + (self._mlp(self.ln_mlp(x)) + a)
        if self.parallel:
            return x + (self._mlp(h_attn) + a)
        x = x + a
        return x + self._mlp(self.post_attention_layernorm(x))


@register_model("falcon")
class FalconModel(RaggedModel):
    """Falcon decoder with rotary positions (HF ``FalconForCausalLM`` weights)."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.model_type = "falcon"
        hidden = cfg["hidden_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_kv_heads"]
        self.head_dim = hidden // self.num_heads
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg.get("max_position_embeddings")
        self.eos_token_ids = eos_list(cfg.get("eos_token_id"))
        self.rotary = RotaryEmbedding(rope_spec(cfg, self.head_dim, "falcon"))
        self.word_embeddings = nn.Embedding(self.vocab_size, hidden)
        self.h = nn.ModuleList([FalconLayer(cfg) for _ in range(self.num_layers)])
        self.ln_f = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_epsilon", 1e-5))
        self.tied = bool(cfg.get("tie_word_embeddings", True))
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.tied:
            self.lm_head.weight = self.word_embeddings.weight

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, [
            falsy("alibi", "ALiBi position bias"),
            falsy("apply_residual_connection_post_layernorm", "residual from the normed input"),
        ]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FalconModel:
        validate_config("falcon", config, *cls.config_fields("falcon"))
        cfg = _normalise(config)
        if cfg.get("new_decoder_architecture") and not cfg.get("parallel_attn", True):
            raise ValueError(
                "falcon config new_decoder_architecture=True with parallel_attn=False is not "
                "supported (HF cannot run it either); set parallel_attn=True."
            )
        if cfg["num_ln_in_parallel_attn"] not in (None, 1, 2):
            raise ValueError(
                f"falcon config num_ln_in_parallel_attn={cfg['num_ln_in_parallel_attn']!r} "
                "must be 1, 2 or null."
            )
        return cls(cfg)

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.word_embeddings(batch.input_ids)  # [N, hidden]
        seq_lens = forward_seq_lens(batch) if self.rotary.length_dependent else None
        cos, sin = self.rotary(batch.positions, x.dtype, seq_lens)  # [N, rot_dim] each
        for i, layer in enumerate(self.h):
            x = layer(x, cos, sin, batch, kv_cache, i)
        x = x[batch.logits_indices]  # [M, hidden]
        return self.lm_head(self.ln_f(x))  # [M, vocab]

    _LAYER_RE = re.compile(r"^h\.(\d+)\.(?:self_attention\.|mlp\.)?(\w+)\.(weight|bias)$")

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight":
            return [] if self.tied else [(name, tensor, None, False)]
        if name.startswith(("word_embeddings.", "ln_f.")):
            return [(name, tensor, None, False)]
        m = self._LAYER_RE.match(name)
        if m is None:
            return None
        idx, module, kind = m.groups()
        if not hasattr(self.h[int(idx)], module):
            return None
        return [(f"h.{idx}.{module}.{kind}", tensor, None, False)]
