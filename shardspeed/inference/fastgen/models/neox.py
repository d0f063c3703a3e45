"""GPT-NeoX / Pythia: LayerNorm, partial rotary, per-head fused QKV, parallel residual.

The checkpoint's ``attention.query_key_value`` rows are ordered per head
(``[head0: q k v, head1: q k v, ...]``); the weight is loaded as-is and split
after the matmul: ``[N, 3 * hidden] -> [N, H, 3 * D] -> q, k, v``.
With ``use_parallel_residual`` the block is ``x + attn(ln1(x)) + mlp(ln2(x))``,
otherwise the usual sequential pre-norm residual.

Tensor parallel: a rank holds the ``query_key_value`` rows of its heads (whole
``[q k v]`` head blocks) and its ``dense_h_to_4h`` rows; ``dense`` and
``dense_4h_to_h`` are row-parallel, each followed by the all-reduce.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.models.base import RaggedModel, WeightTarget
from shardspeed.inference.fastgen.models.config_check import Refusal, validate_config
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
    TensorShard,
    column,
    head_rows,
    row,
)

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch

_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_act", "max_position_embeddings", "layer_norm_eps", "tie_word_embeddings",
    "use_parallel_residual", "rope_parameters", "rope_scaling", "rope_theta", "rotary_pct",
    "rotary_emb_base", "partial_rotary_factor", "attention_bias", "eos_token_id",
)  # fmt: skip


class NeoXLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], shard: TensorShard = NO_SHARD):
        super().__init__()
        self.shard = shard
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-5)
        mlp = ("dense_h_to_4h", "dense_4h_to_h")
        heads = shard.heads(cfg["num_attention_heads"], cfg["num_attention_heads"], "gpt_neox")
        self.num_heads = heads.num_heads
        self.head_dim = hidden // cfg["num_attention_heads"]
        width = self.num_heads * self.head_dim  # this rank's share of hidden
        self.splits = {
            "query_key_value": column([head_rows(heads.q_heads, 3 * self.head_dim)], 3 * hidden),
            "dense": row([head_rows(heads.q_heads, self.head_dim)], hidden),
            **mlp_splits(shard, mlp, cfg["intermediate_size"], "intermediate_size", "gpt_neox"),
        }
        local_inter = len(self.splits["dense_h_to_4h"].pieces[0])
        bias = bool(cfg.get("attention_bias", True))
        self.parallel = bool(cfg.get("use_parallel_residual", True))
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.query_key_value = nn.Linear(hidden, 3 * width, bias=bias)
        self.dense = nn.Linear(width, hidden, bias=bias)
        self.dense_h_to_4h = nn.Linear(hidden, local_inter)
        self.dense_4h_to_h = nn.Linear(local_inter, hidden)
        self.act = activation(cfg.get("hidden_act", "gelu"), "hidden_act")

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
        qkv = self.query_key_value(self.input_layernorm(x))  # [N, 3 * H * D]
        q, k, v = qkv.view(n, self.num_heads, 3 * self.head_dim).chunk(3, dim=-1)  # [N, H, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = attention_output(self.shard, self.dense, q, k, v, kv_cache, layer, batch)
        if self.parallel:  # summed in HF's order: (mlp + attn) + x
            return (self._mlp(self.post_attention_layernorm(x)) + a) + x
        x = x + a
        return x + self._mlp(self.post_attention_layernorm(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.reduce(self.dense_4h_to_h(self.act(self.dense_h_to_4h(x))))


@register_model("gpt_neox")
class GPTNeoXModel(RaggedModel):
    """GPT-NeoX / Pythia decoder; ``shard`` builds one tensor-parallel rank's part."""

    supports_tensor_parallel = True
    tied_embedding = "embed_in"

    def __init__(self, cfg: dict[str, Any], shard: TensorShard = NO_SHARD):
        super().__init__()
        self.model_type = "gpt_neox"
        self.shard = shard
        hidden = cfg["hidden_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.layers = nn.ModuleList([NeoXLayer(cfg, shard) for _ in range(self.num_layers)])
        self.num_heads = self.num_kv_heads = cfg["num_attention_heads"] // shard.world_size
        self.head_dim = hidden // cfg["num_attention_heads"]
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg.get("max_position_embeddings")
        self.eos_token_ids = eos_list(cfg.get("eos_token_id"))
        rope_cfg = dict(cfg)
        if "rotary_pct" in cfg:  # pre-transformers-5 names
            rope_cfg.setdefault("partial_rotary_factor", cfg["rotary_pct"])
        if "rotary_emb_base" in cfg:
            rope_cfg.setdefault("rope_theta", cfg["rotary_emb_base"])
        self.rotary = RotaryEmbedding(rope_spec(rope_cfg, self.head_dim, "gpt_neox"))
        self.embed_in = nn.Embedding(self.vocab_size, hidden)
        self.final_layer_norm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-5))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = nn.Linear(hidden, self.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, []

    @classmethod
    def from_config(cls, config: dict[str, Any], shard: TensorShard = NO_SHARD) -> GPTNeoXModel:
        validate_config("gpt_neox", config, *cls.config_fields("gpt_neox"))
        return cls(config, shard)

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.embed_in(batch.input_ids)  # [N, hidden]
        x = run_layers(self.layers, x, batch, kv_cache, self.rotary)  # [M, hidden]
        return self.lm_head(self.final_layer_norm(x))  # [M, vocab]

    _LAYER_RE = re.compile(r"^layers\.(\d+)\.(?:attention\.|mlp\.)?(\w+)\.(weight|bias)$")

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        name = name.removeprefix("gpt_neox.")
        if name in ("embed_out.weight", "lm_head.weight"):
            return [] if self.tied else [("lm_head.weight", tensor, None, False)]
        if name.startswith(("embed_in.", "final_layer_norm.")):
            return [(name, tensor, None, False)]
        if re.match(r"^layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$", name):
            return []  # causal-mask / rotary buffers of old checkpoints
        m = self._LAYER_RE.match(name)
        return None if m is None else self.layer_target("layers", self.layers, m, tensor)
