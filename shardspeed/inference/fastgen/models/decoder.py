"""The pre-norm RMSNorm + RoPE decoder shared by the Llama-like families.

One configurable block covers Llama, Mistral, Qwen2/3, Phi-3, Gemma, Gemma 2 and
Mixtral; each family file turns its HF config into a :class:`DecoderSpec`
(refusing what it cannot honour) and registers the ``model_type``. Layer
parameter names follow HF's (``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ``q_norm``...) with q/k/v fused into
``qkv_proj`` and gate/up into ``gate_up_proj``.

Per layer::

    h = input_layernorm(x)
    q, k, v = qkv_proj(h); q, k = q_norm(q), k_norm(k)    # qk_norm (Qwen3)
    a = o_proj(attention(rope(q), rope(k), v, window, scale, softcap))
    sandwich (Gemma 2): x += post_attention_layernorm(a)
                        x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    otherwise:          x += a; x += mlp(post_attention_layernorm(x))
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.attention import paged_attention
from shardspeed.inference.fastgen.models.base import RaggedModel, WeightTarget
from shardspeed.inference.fastgen.models.config_check import Refusal
from shardspeed.inference.fastgen.models.layers import RMSNorm, activation, softcap
from shardspeed.inference.fastgen.models.rope import (
    RopeSpec,
    RotaryEmbedding,
    apply_rope,
    forward_seq_lens,
)

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch


@dataclass
class DecoderSpec:
    """Everything the decoder computes with, resolved from an HF config."""

    model_type: str
    vocab_size: int
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    act: str
    rope: RopeSpec
    max_positions: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    act_field: str = "hidden_act"  # config key named in activation errors
    norm_offset: float = 0.0  # 1.0 => Gemma's (1 + weight) RMSNorm
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sandwich_norm: bool = False  # Gemma 2: extra post-attention / pre+post-MLP norms
    layer_windows: list[int | None] = field(default_factory=list)  # sliding window per layer
    attn_scale: float | None = None  # None => head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None  # Gemma: sqrt(hidden)
    tied: bool = False
    num_experts: int = 0  # > 0 => sparse MoE MLP (Mixtral)
    top_k: int = 0


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int, act: str, act_field: str, bias: bool):
        super().__init__()
        self.intermediate = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act, act_field)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [N, inter]
        return self.down_proj(self.act(gate) * up)


class SparseMoE(nn.Module):
    """Top-k routed experts, HF Mixtral semantics: softmax (fp32) -> top-k -> renormalise.

    All experts are local; each expert runs on the tokens routed to it.
    """

    def __init__(self, s: DecoderSpec):
        super().__init__()
        self.top_k = s.top_k
        self.gate = nn.Linear(s.hidden, s.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [
                GatedMLP(s.hidden, s.intermediate, s.act, s.act_field, False)
                for _ in range(s.num_experts)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [N, k] each
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)  # [N, hidden]
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)  # tokens routed to e, and at which rank
            y = self.experts[e](x[token]) * weights[token, slot, None]  # [T_e, hidden]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, s: DecoderSpec, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.window = s.layer_windows[layer_idx] if s.layer_windows else None
        self.scale, self.softcap = s.attn_scale, s.attn_softcap
        self.sandwich = s.sandwich_norm

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, s.eps, s.norm_offset)

        self.input_layernorm = norm(s.hidden)
        self.qkv_proj = nn.Linear(s.hidden, q_size + 2 * kv_size, bias=s.qkv_bias)
        self.o_proj = nn.Linear(q_size, s.hidden, bias=s.o_bias)
        self.q_norm = norm(s.head_dim) if s.qk_norm else None
        self.k_norm = norm(s.head_dim) if s.qk_norm else None
        self.post_attention_layernorm = norm(s.hidden)
        if s.sandwich_norm:
            self.pre_feedforward_layernorm = norm(s.hidden)
            self.post_feedforward_layernorm = norm(s.hidden)
        self.mlp: nn.Module
        if s.num_experts:
            self.mlp = SparseMoE(s)
        else:
            self.mlp = GatedMLP(s.hidden, s.intermediate, s.act, s.act_field, s.mlp_bias)

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
        q = q.view(n, self.num_heads, self.head_dim)  # [N, H, D]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [N, H_kv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [N, H_kv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = paged_attention(
            q, k, v, kv_cache, layer, batch.slot_mapping, batch.attn,
            window=self.window, scale=self.scale, softcap=self.softcap,
        )  # fmt: skip
        a = self.o_proj(o.reshape(n, -1))  # [N, hidden]
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            h = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(h)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(RaggedModel):
    """Ragged decoder built from a :class:`DecoderSpec`; subclasses implement ``spec_from_config``."""

    def __init__(self, s: DecoderSpec):
        super().__init__()
        self.spec = s
        self.model_type = s.model_type
        self.num_layers = s.num_layers
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.vocab_size = s.vocab_size
        self.max_positions = s.max_positions
        self.eos_token_ids = list(s.eos_token_ids)
        windows = set(s.layer_windows) if s.layer_windows else {None}
        self.kv_window = windows.pop() if len(windows) == 1 else None
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden)
        self.layers = nn.ModuleList([DecoderLayer(s, i) for i in range(s.num_layers)])
        self.norm = RMSNorm(s.hidden, s.eps, s.norm_offset)
        self.rotary = RotaryEmbedding(s.rope)
        self.tied = s.tied
        self.lm_head = nn.Linear(s.hidden, s.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        """(config keys the forward honours, refusal rules) of ``model_type``."""
        raise NotImplementedError

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        """Validate ``config`` (see :mod:`.config_check`) and resolve it to a spec."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DecoderModel:
        return cls(cls.spec_from_config(config))

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # [N, hidden]
        if self.spec.embed_scale is not None:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        seq_lens = forward_seq_lens(batch) if self.rotary.length_dependent else None
        cos, sin = self.rotary(batch.positions, x.dtype, seq_lens)  # [N, rot_dim] each
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, kv_cache, i)
        x = x[batch.logits_indices]  # [M, hidden]: only rows that need logits
        return softcap(self.lm_head(self.norm(x)), self.spec.final_softcap)  # [M, vocab]

    _LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
    _NORMS = (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm",
    )  # fmt: skip

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight"):
            return [(name, tensor, None, False)]
        if name == "lm_head.weight":
            return [] if self.tied else [(name, tensor, None, False)]
        if "rotary_emb" in name:
            return []
        m = self._LAYER_RE.match(name)
        if m is None:
            return self._map_experts(name, tensor)
        idx, module, kind = m.groups()
        layer = self.layers[int(idx)]
        prefix = f"layers.{idx}."
        if module in self._NORMS:
            return [(f"{prefix}{module.removeprefix('self_attn.')}.{kind}", tensor, None, False)]
        q, kv = layer.split[0], layer.split[1]
        attn_rows = {
            "self_attn.q_proj": ("qkv_proj", slice(0, q)),
            "self_attn.k_proj": ("qkv_proj", slice(q, q + kv)),
            "self_attn.v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
            "self_attn.qkv_proj": ("qkv_proj", None),  # Phi-3: already fused q, k, v
            "self_attn.o_proj": ("o_proj", None),
        }
        if module in attn_rows:
            target, rows = attn_rows[module]
            return [(f"{prefix}{target}.{kind}", tensor, rows, False)]
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            inter = mlp.intermediate
            mlp_rows = {
                "mlp.gate_proj": ("gate_up_proj", slice(0, inter)),
                "mlp.up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
                "mlp.gate_up_proj": ("gate_up_proj", None),  # Phi-3: gate then up
                "mlp.down_proj": ("down_proj", None),
            }
            if module in mlp_rows:
                target, rows = mlp_rows[module]
                return [(f"{prefix}mlp.{target}.{kind}", tensor, rows, False)]
            return None
        return self._map_moe(int(idx), module, kind, tensor)

    _EXPERTS_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")

    def _map_experts(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        """transformers >= 5 stores all experts of a layer as one 3-D tensor ``[E, out, in]``."""
        m = self._EXPERTS_RE.match(name)
        if m is None or not self.spec.num_experts:
            return None
        idx, proj = m.groups()
        return [
            (f"layers.{idx}.mlp.experts.{e}.{proj}.weight", tensor[e], None, False)
            for e in range(tensor.shape[0])
        ]

    def _map_moe(
        self, idx: int, module: str, kind: str, tensor: torch.Tensor
    ) -> list[WeightTarget] | None:
        """Router and per-expert weights (``block_sparse_moe.experts.{e}.w1/w2/w3`` layout)."""
        module = module.replace("block_sparse_moe.", "mlp.")
        if module == "mlp.gate":
            return [(f"layers.{idx}.mlp.gate.{kind}", tensor, None, False)]
        m = re.match(r"^mlp\.experts\.(\d+)\.(w1|w2|w3)$", module)
        if m is None:
            return None
        e, w = m.groups()
        inter = self.spec.intermediate
        prefix = f"layers.{idx}.mlp.experts.{e}."
        target = {
            "w1": ("gate_up_proj", slice(0, inter)),  # gate
            "w3": ("gate_up_proj", slice(inter, 2 * inter)),  # up
            "w2": ("down_proj", None),
        }[w]
        return [(f"{prefix}{target[0]}.{kind}", tensor, target[1], False)]


def eos_list(value: Any) -> list[int]:
    """HF ``eos_token_id`` (int, list or None) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


SLIDING, FULL = "sliding_attention", "full_attention"


def layer_windows(
    model_type: str, config: dict[str, Any], window: int | None, default_types: list[str]
) -> list[int | None]:
    """Sliding window per layer from ``layer_types`` (or ``default_types`` when absent)."""
    types = config.get("layer_types") or default_types
    if len(types) != config["num_hidden_layers"]:
        raise ValueError(
            f"{model_type} config layer_types has {len(types)} entries for "
            f"num_hidden_layers={config['num_hidden_layers']}; give one per layer."
        )
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if bad:
        raise ValueError(
            f"{model_type} config layer_types contains {bad}; the FastGen engine supports "
            f"{[SLIDING, FULL]}."
        )
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{model_type} config sliding_window={window!r} must be an int >= 1.")
    return [window if t == SLIDING else None for t in types]
