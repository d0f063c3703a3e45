"""GPT-2 family (learned positions, pre-LayerNorm, fused QKV, tied LM head).

HF GPT-2 stores its projections as ``Conv1D`` with weights ``[in, out]``; they
are transposed on load. ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx``
set the score scale per layer. ``reorder_and_upcast_attn`` only changes the
precision of HF's scores (fp32), not the math: identical for fp32 weights; in
half precision the engine's scores keep the attention backend's precision. :mod:`shardspeed_gpt` reuses :class:`GPTModel` with our
own GPT's names and ``nn.Linear`` layout.

Tensor parallel (a :class:`~.tp_shard.TensorShard`): ``c_attn`` and ``c_fc`` are
column-parallel (this rank's heads of each of q, k, v; its rows of the MLP),
``attn_proj`` and ``mlp_proj`` row-parallel, each followed by the all-reduce.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.attention import paged_attention
from shardspeed.inference.fastgen.models.base import RaggedModel, WeightTarget
from shardspeed.inference.fastgen.models.config_check import Refusal, falsy, validate_config
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


@dataclass
class GPTShape:
    vocab_size: int
    max_positions: int
    hidden: int
    num_layers: int
    num_heads: int
    inner: int
    eps: float
    bias: bool
    activation: str
    eos_token_ids: list[int]
    tied: bool = True
    scale_attn_weights: bool = True  # False => raw q.k scores
    scale_attn_by_inverse_layer_idx: bool = False  # scores / (layer_idx + 1)


class GPTBlock(nn.Module):
    """One pre-LayerNorm block; with a sharded ``shard``, this rank's heads and MLP rows."""

    def __init__(self, s: GPTShape, layer_idx: int = 0, shard: TensorShard = NO_SHARD):
        super().__init__()
        self.shard = shard
        self.head_dim = s.hidden // s.num_heads
        self.heads = shard.heads(s.num_heads, s.num_heads, "gpt2")
        self.inner_rows = shard.split(s.inner, "n_inner", "gpt2")
        self.num_heads = self.heads.num_heads
        width = self.num_heads * self.head_dim  # this rank's share of hidden
        scale = self.head_dim**-0.5 if s.scale_attn_weights else 1.0
        if s.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.scale = scale
        self.ln_1 = nn.LayerNorm(s.hidden, eps=s.eps, bias=s.bias)
        self.c_attn = nn.Linear(s.hidden, 3 * width, bias=s.bias)
        self.attn_proj = nn.Linear(width, s.hidden, bias=s.bias)
        self.ln_2 = nn.LayerNorm(s.hidden, eps=s.eps, bias=s.bias)
        self.c_fc = nn.Linear(s.hidden, len(self.inner_rows), bias=s.bias)
        self.mlp_proj = nn.Linear(len(self.inner_rows), s.hidden, bias=s.bias)
        self.act = activation(s.activation, "activation_function")
        rows = head_rows(self.heads.q_heads, self.head_dim)  # c_attn: [q | k | v] heads of r
        qkv = [rows, *(range(rows.start + i * s.hidden, rows.stop + i * s.hidden) for i in (1, 2))]
        self.splits = {
            "c_attn": column(qkv, 3 * s.hidden),
            "attn_proj": row([rows], s.hidden),
            "c_fc": column([self.inner_rows], s.inner),
            "mlp_proj": row([self.inner_rows], s.inner),
        }

    def forward(
        self, x: torch.Tensor, batch: RaggedBatch, kv_cache: KVCache, layer: int
    ) -> torch.Tensor:
        n = x.shape[0]  # x: [N, hidden]
        c = self.num_heads * self.head_dim  # this rank's share of hidden
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=-1)  # each [N, c]
        shape = (n, self.num_heads, self.head_dim)
        o = paged_attention(
            q.view(shape),
            k.view(shape),
            v.view(shape),
            kv_cache,
            layer,
            batch.slot_mapping,
            batch.attn,
            scale=self.scale,
        )  # [N, H, D]
        x = x + self.shard.reduce(self.attn_proj(o.reshape(n, c)))  # [N, hidden]
        return x + self.shard.reduce(self.mlp_proj(self.act(self.c_fc(self.ln_2(x)))))


@register_model("gpt2")
class GPTModel(RaggedModel):
    """Learned-position GPT decoder (HF GPT-2 weights by default)."""

    conv1d_weights = True  # HF GPT-2 Conv1D stores [in, out]
    learned_positions = True
    supports_tensor_parallel = True
    tied_embedding = "wte"

    def __init__(self, s: GPTShape, model_type: str = "gpt2", shard: TensorShard = NO_SHARD):
        super().__init__()
        self.shape = s
        self.shard = shard
        self.model_type = model_type
        self.num_layers = s.num_layers
        self.num_heads = self.num_kv_heads = s.num_heads // shard.world_size
        self.head_dim = s.hidden // s.num_heads
        self.vocab_size = s.vocab_size
        self.max_positions = s.max_positions
        self.eos_token_ids = list(s.eos_token_ids)
        self.wte = nn.Embedding(s.vocab_size, s.hidden)
        self.wpe = nn.Embedding(s.max_positions, s.hidden)
        self.h = nn.ModuleList([GPTBlock(s, i, shard) for i in range(s.num_layers)])
        self.ln_f = nn.LayerNorm(s.hidden, eps=s.eps, bias=s.bias)
        self.tied = s.tied
        self.lm_head = nn.Linear(s.hidden, s.vocab_size, bias=False)
        self.tie_weights()

    CONFIG_KEYS = (
        "vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
        "layer_norm_epsilon", "activation_function", "eos_token_id", "tie_word_embeddings",
        "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
    )  # fmt: skip

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        """(keys the forward honours, refusal rules) for :func:`validate_config`."""
        return cls.CONFIG_KEYS, [falsy("add_cross_attention", "cross-attention")]

    @classmethod
    def from_config(cls, config: dict[str, Any], shard: TensorShard = NO_SHARD) -> GPTModel:
        validate_config("gpt2", config, *cls.config_fields("gpt2"))
        hidden = config["n_embd"]
        eos = config.get("eos_token_id")
        shape = GPTShape(
            vocab_size=config["vocab_size"],
            max_positions=config["n_positions"],
            hidden=hidden,
            num_layers=config["n_layer"],
            num_heads=config["n_head"],
            inner=config.get("n_inner") or 4 * hidden,
            eps=config.get("layer_norm_epsilon", 1e-5),
            bias=True,
            activation=config.get("activation_function", "gelu_new"),
            eos_token_ids=[] if eos is None else [int(eos)],
            tied=bool(config.get("tie_word_embeddings", True)),
            scale_attn_weights=bool(config.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(config.get("scale_attn_by_inverse_layer_idx")),
        )
        return cls(shape, shard=shard)

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.wte(batch.input_ids) + self.wpe(batch.positions)  # [N, hidden]
        for i, block in enumerate(self.h):
            x = block(x, batch, kv_cache, i)
        x = x[batch.logits_indices]  # [M, hidden]
        return self.lm_head(self.ln_f(x))  # [M, vocab]

    _BLOCK_RE = re.compile(
        r"^h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)$"
    )
    _RENAME = {
        "ln_1": "ln_1",
        "ln_2": "ln_2",
        "attn.c_attn": "c_attn",
        "attn.c_proj": "attn_proj",
        "mlp.c_fc": "c_fc",
        "mlp.c_proj": "mlp_proj",
    }

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        name = name.removeprefix("transformer.")
        if name in ("wte.weight", "wpe.weight") or name.startswith("ln_f."):
            return [(name, tensor, None, False)]
        if name == "lm_head.weight":
            return [] if self.tied else [(name, tensor, None, False)]
        m = self._BLOCK_RE.match(name)
        if m is None:
            # causal-mask buffers of old GPT-2 checkpoints
            return [] if re.match(r"^h\.\d+\.attn\.(bias|masked_bias)$", name) else None
        idx, module, kind = m.groups()
        target = f"h.{idx}.{self._RENAME[module]}.{kind}"
        if module.startswith("ln"):
            return [(target, tensor, None, False)]
        if self.conv1d_weights and kind == "weight":
            tensor = tensor.t()  # Conv1D [in, out] -> Linear [out, in]
        split = self.h[int(idx)].splits[self._RENAME[module]]
        return [self.split_target(target, tensor, split)]
