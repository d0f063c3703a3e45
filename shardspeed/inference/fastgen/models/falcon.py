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

Tensor parallel: a rank holds the fused rows of its query heads and KV heads in the
same layout (:func:`_qkv_rows`; a KV head is replicated on the ranks that share it
when there are fewer than ranks, e.g. multi-query) and its ``dense_h_to_4h`` rows;
``dense`` and ``dense_4h_to_h`` are row-parallel, each followed by the all-reduce.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.models.base import RaggedModel, WeightTarget
from shardspeed.inference.fastgen.models.config_check import Refusal, falsy, validate_config
from shardspeed.inference.fastgen.models.decoder import eos_list
from shardspeed.inference.fastgen.models.layer_stack import (
    attention_output,
    mlp_splits,
    run_layers,
)
from shardspeed.inference.fastgen.models.layers import activation
from shardspeed.inference.fastgen.models.registry import register_model
from shardspeed.inference.fastgen.models.rope import RotaryEmbedding, apply_rope, rope_spec
from shardspeed.inference.fastgen.models.tp_shard import (
    NO_SHARD,
    HeadShard,
    TensorShard,
    column,
    head_rows,
    row,
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


def _qkv_rows(cfg: dict[str, Any], heads: HeadShard, d: int) -> list[range]:
    """The fused ``query_key_value`` rows a rank holds, in the layout its ``_split_qkv`` reads.

    New architecture: per local KV group, its local query heads then its k and v;
    multi-query: the local query heads then the one (replicated) k and v; otherwise
    the local heads' ``[q k v]`` blocks.
    """
    h, h_kv = cfg["num_attention_heads"], cfg["num_kv_heads"]
    if cfg.get("new_decoder_architecture", False):
        r = h // h_kv  # query heads per KV group
        pieces = []
        for g in heads.kv_heads:
            base = g * (r + 2) * d  # group g: [q_0 .. q_{r-1}, k, v]
            group_q = range(max(heads.q_heads.start, g * r), min(heads.q_heads.stop, (g + 1) * r))
            pieces.append(head_rows(range(group_q.start - g * r, group_q.stop - g * r), d, base))
            pieces.append(range(base + r * d, base + (r + 2) * d))
        return pieces
    if cfg.get("multi_query", True):
        return [head_rows(heads.q_heads, d), range(h * d, (h + 2) * d)]
    return [head_rows(heads.q_heads, 3 * d)]


class FalconLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], shard: TensorShard = NO_SHARD):
        super().__init__()
        self.shard = shard
        hidden, eps, bias = cfg["hidden_size"], cfg.get("layer_norm_epsilon", 1e-5), cfg["bias"]
        heads = shard.heads(cfg["num_attention_heads"], cfg["num_kv_heads"], "falcon")
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = d = hidden // cfg["num_attention_heads"]
        qkv_full = (cfg["num_attention_heads"] + 2 * cfg["num_kv_heads"]) * d
        mlp = ("dense_h_to_4h", "dense_4h_to_h")
        self.splits = {
            "query_key_value": column(_qkv_rows(cfg, heads, d), qkv_full),
            "dense": row([head_rows(heads.q_heads, d)], hidden),
            **mlp_splits(shard, mlp, cfg["ffn_hidden_size"], "ffn_hidden_size", "falcon"),
        }
        local_ffn = len(self.splits["dense_h_to_4h"].pieces[0])
        self.new_arch = bool(cfg.get("new_decoder_architecture", False))
        self.multi_query = bool(cfg.get("multi_query", True))
        self.parallel = bool(cfg.get("parallel_attn", True))
        self.two_norms = self.new_arch and cfg["num_ln_in_parallel_attn"] == 2
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * d
        self.query_key_value = nn.Linear(hidden, qkv_out, bias=bias)
        self.dense = nn.Linear(self.num_heads * d, hidden, bias=bias)
        self.dense_h_to_4h = nn.Linear(hidden, local_ffn, bias=bias)
        self.dense_4h_to_h = nn.Linear(local_ffn, hidden, bias=bias)
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
        return self.shard.reduce(self.dense_4h_to_h(self.act(self.dense_h_to_4h(x))))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: RaggedBatch,
        kv_cache: KVCache,
        layer: int,
    ) -> torch.Tensor:
        h_attn = self.ln_attn(x) if self.two_norms else self.input_layernorm(x)  # x: [N, hidden]
        q, k, v = self._split_qkv(self.query_key_value(h_attn))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = attention_output(self.shard, self.dense, q, k, v, kv_cache, layer, batch)
        if self.two_norms:
            return x + (self._mlp(self.ln_mlp(x)) + a)
        if self.parallel:
            return x + (self._mlp(h_attn) + a)
        x = x + a
        return x + self._mlp(self.post_attention_layernorm(x))


@register_model("falcon")
class FalconModel(RaggedModel):
    """Falcon decoder with rotary positions (HF ``FalconForCausalLM`` weights); ``shard``
    builds one tensor-parallel rank's part."""

    supports_tensor_parallel = True
    tied_embedding = "word_embeddings"

    def __init__(self, cfg: dict[str, Any], shard: TensorShard = NO_SHARD):
        super().__init__()
        self.model_type = "falcon"
        self.shard = shard
        hidden = cfg["hidden_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.h = nn.ModuleList([FalconLayer(cfg, shard) for _ in range(self.num_layers)])
        heads = shard.heads(cfg["num_attention_heads"], cfg["num_kv_heads"], "falcon")
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = hidden // cfg["num_attention_heads"]
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg.get("max_position_embeddings")
        self.eos_token_ids = eos_list(cfg.get("eos_token_id"))
        self.rotary = RotaryEmbedding(rope_spec(cfg, self.head_dim, "falcon"))
        self.word_embeddings = nn.Embedding(self.vocab_size, hidden)
        self.ln_f = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_epsilon", 1e-5))
        self.tied = bool(cfg.get("tie_word_embeddings", True))
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, [
            falsy("alibi", "ALiBi position bias"),
            falsy("apply_residual_connection_post_layernorm", "residual from the normed input"),
        ]

    @classmethod
    def from_config(cls, config: dict[str, Any], shard: TensorShard = NO_SHARD) -> FalconModel:
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
        return cls(cfg, shard)

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.word_embeddings(batch.input_ids)  # [N, hidden]
        x = run_layers(self.h, x, batch, kv_cache, self.rotary)  # [M, hidden]
        return self.lm_head(self.ln_f(x))  # [M, vocab]

    _LAYER_RE = re.compile(r"^h\.(\d+)\.(?:self_attention\.|mlp\.)?(\w+)\.(weight|bias)$")

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight":
            return [] if self.tied else [(name, tensor, None, False)]
        if name.startswith(("word_embeddings.", "ln_f.")):
            return [(name, tensor, None, False)]
        m = self._LAYER_RE.match(name)
        return None if m is None else self.layer_target("h", self.h, m, tensor)
