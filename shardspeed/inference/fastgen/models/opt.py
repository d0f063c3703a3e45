"""OPT: learned positions (offset by 2), LayerNorm, pre- or post-norm blocks.

``do_layer_norm_before=False`` (OPT-350m) gives post-norm blocks and no final
norm; ``word_embed_proj_dim != hidden_size`` adds the ``project_in`` /
``project_out`` matrices around the decoder. Queries are scaled before the
score matmul, as in HF.

Tensor parallel: ``q_proj`` / ``k_proj`` / ``v_proj`` hold a rank's head rows and
``fc1`` its MLP rows; ``out_proj`` and ``fc2`` are row-parallel, each followed by
the all-reduce (before the post-norm, which needs the whole sum).
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
    "vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim", "max_position_embeddings",
    "do_layer_norm_before", "_remove_final_layer_norm", "word_embed_proj_dim",
    "num_attention_heads", "activation_function", "enable_bias", "layer_norm_elementwise_affine",
    "tie_word_embeddings", "eos_token_id",
)  # fmt: skip
_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


class OPTLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], shard: TensorShard = NO_SHARD):
        super().__init__()
        self.shard = shard
        hidden, ffn = cfg["hidden_size"], cfg["ffn_dim"]
        heads = shard.heads(cfg["num_attention_heads"], cfg["num_attention_heads"], "opt")
        self.num_heads = heads.num_heads
        self.head_dim = hidden // cfg["num_attention_heads"]
        width = self.num_heads * self.head_dim  # this rank's share of hidden
        rows = head_rows(heads.q_heads, self.head_dim)
        self.splits = {
            **{proj: column([rows], hidden) for proj in ("q_proj", "k_proj", "v_proj")},
            "out_proj": row([rows], hidden),
            **mlp_splits(shard, ("fc1", "fc2"), ffn, "ffn_dim", "opt"),
        }
        local_ffn = len(self.splits["fc1"].pieces[0])
        self.scaling = self.head_dim**-0.5
        bias = bool(cfg.get("enable_bias", True))
        affine = bool(cfg.get("layer_norm_elementwise_affine", True))
        self.pre_norm = bool(cfg.get("do_layer_norm_before", True))
        self.q_proj = nn.Linear(hidden, width, bias=bias)
        self.k_proj = nn.Linear(hidden, width, bias=bias)
        self.v_proj = nn.Linear(hidden, width, bias=bias)
        self.out_proj = nn.Linear(width, hidden, bias=bias)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = nn.Linear(hidden, local_ffn, bias=bias)
        self.fc2 = nn.Linear(local_ffn, hidden, bias=bias)
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.act = activation(cfg.get("activation_function", "relu"), "activation_function")

    def forward(
        self, x: torch.Tensor, batch: RaggedBatch, kv_cache: KVCache, layer: int
    ) -> torch.Tensor:
        n = x.shape[0]  # x: [N, hidden]
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        shape = (n, self.num_heads, self.head_dim)
        q = (self.q_proj(h) * self.scaling).view(shape)  # [N, H, D]
        k, v = self.k_proj(h).view(shape), self.v_proj(h).view(shape)  # [N, H, D]
        x = x + attention_output(
            self.shard, self.out_proj, q, k, v, kv_cache, layer, batch, scale=1.0
        )  # fmt: skip
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.shard.reduce(self.fc2(self.act(self.fc1(h))))
        return x if self.pre_norm else self.final_layer_norm(x)


@register_model("opt")
class OPTModel(RaggedModel):
    """OPT decoder (HF ``OPTForCausalLM`` weights); ``shard`` builds one rank's part."""

    learned_positions = True
    supports_tensor_parallel = True
    tied_embedding = "embed_tokens"

    def __init__(self, cfg: dict[str, Any], shard: TensorShard = NO_SHARD):
        super().__init__()
        self.model_type = "opt"
        self.shard = shard
        hidden = cfg["hidden_size"]
        proj = cfg.get("word_embed_proj_dim") or hidden
        self.num_layers = cfg["num_hidden_layers"]
        self.layers = nn.ModuleList([OPTLayer(cfg, shard) for _ in range(self.num_layers)])
        self.num_heads = self.num_kv_heads = cfg["num_attention_heads"] // shard.world_size
        self.head_dim = hidden // cfg["num_attention_heads"]
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg["max_position_embeddings"]
        self.eos_token_ids = eos_list(cfg.get("eos_token_id"))
        self.embed_tokens = nn.Embedding(self.vocab_size, proj)
        self.embed_positions = nn.Embedding(self.max_positions + _POSITION_OFFSET, hidden)
        self.project_in = nn.Linear(proj, hidden, bias=False) if proj != hidden else None
        self.project_out = nn.Linear(hidden, proj, bias=False) if proj != hidden else None
        final = cfg.get("do_layer_norm_before", True) and not cfg.get("_remove_final_layer_norm")
        affine = bool(cfg.get("layer_norm_elementwise_affine", True))
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine) if final else None
        self.tied = bool(cfg.get("tie_word_embeddings", True))
        self.lm_head = nn.Linear(proj, self.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        return _KEYS, []

    @classmethod
    def from_config(cls, config: dict[str, Any], shard: TensorShard = NO_SHARD) -> OPTModel:
        validate_config("opt", config, *cls.config_fields("opt"))
        return cls(config, shard)

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # [N, proj]
        if self.project_in is not None:
            x = self.project_in(x)  # [N, hidden]
        x = x + self.embed_positions(batch.positions + _POSITION_OFFSET)
        x = run_layers(self.layers, x, batch, kv_cache)  # [M, hidden]
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [M, proj]
        return self.lm_head(x)  # [M, vocab]

    _LAYER_RE = re.compile(r"^layers\.(\d+)\.(?:self_attn\.)?(\w+)\.(weight|bias)$")
    _TOP = ("embed_tokens.", "embed_positions.", "project_in.", "project_out.", "final_layer_norm.")

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        name = name.removeprefix("model.").removeprefix("decoder.")
        if name == "lm_head.weight":
            return [] if self.tied else [(name, tensor, None, False)]
        if name.startswith(self._TOP):
            return [(name, tensor, None, False)]
        m = self._LAYER_RE.match(name)
        return None if m is None else self.layer_target("layers", self.layers, m, tensor)
