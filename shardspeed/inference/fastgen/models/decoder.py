"""The pre-norm RMSNorm + RoPE decoder shared by the Llama-like families.

One configurable block covers Llama, Mistral, Qwen2/3, Phi-3, Gemma, Gemma 2, Mixtral
and Qwen2/3-MoE (the MLP blocks are in :mod:`~.moe`); each family file turns its HF config into a :class:`DecoderSpec`
(refusing what it cannot honour) and registers the ``model_type``. Layer
parameter names follow HF's (``input_layernorm``, ``post_attention_layernorm``,
``pre_feedforward_layernorm``, ``q_norm``...) with q/k/v fused into
``qkv_proj`` and gate/up into ``gate_up_proj``.

Per layer::

    h = input_layernorm(x)
    q, k, v = qkv_proj(h); q, k = q_norm(q), k_norm(k)    # qk_norm (Qwen3)
    a = reduce(o_proj(attention(rope(q), rope(k), v, window, scale, softcap)))
    sandwich (Gemma 2): x += post_attention_layernorm(a)
                        x += post_feedforward_layernorm(reduce(mlp(pre_feedforward_layernorm(x))))
    otherwise:          x += a; x += reduce(mlp(post_attention_layernorm(x)))

``reduce`` is the tensor-parallel all-reduce (identity on one rank): a model built
with a :class:`~.tp_shard.TensorShard` holds only its rank's heads and MLP rows,
sliced from the checkpoint in :meth:`DecoderModel.map_weight` (layout in
:mod:`~shardspeed.inference.fastgen.models.tp_shard`).
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
from shardspeed.inference.fastgen.models.layer_stack import run_layers
from shardspeed.inference.fastgen.models.layers import RMSNorm, softcap
from shardspeed.inference.fastgen.models.moe import GatedMLP, MoESpec, SparseMoE
from shardspeed.inference.fastgen.models.rope import RopeSpec, RotaryEmbedding, apply_rope_owned
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD, TensorShard, head_rows, take

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
    num_experts: int = 0  # > 0 => sparse MoE MLP (Mixtral, Qwen2/3-MoE)
    top_k: int = 0
    moe_intermediate: int = 0  # each routed expert's width; 0 => intermediate
    norm_topk_prob: bool = True  # renormalise the top-k routing weights
    shared_expert_intermediate: int = 0  # > 0 => a shared expert beside the routed ones
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid gate on the shared expert
    moe_layers: list[bool] = field(default_factory=list)  # per layer; empty => all sparse

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the routed MLP (else the dense gated MLP)."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer_idx])


class DecoderLayer(nn.Module):
    """One block; with a sharded ``shard`` it holds this rank's heads and MLP rows only."""

    def __init__(self, s: DecoderSpec, layer_idx: int, shard: TensorShard = NO_SHARD):
        super().__init__()
        self.shard = shard
        self.heads = shard.heads(s.num_heads, s.num_kv_heads, s.model_type)
        dense_mlp = not s.is_moe_layer(layer_idx)
        self.inter_rows = (
            shard.split(s.intermediate, "intermediate_size", s.model_type)
            if dense_mlp
            else range(0)
        )
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.head_dim = s.head_dim
        q_size, kv_size = self.num_heads * s.head_dim, self.num_kv_heads * s.head_dim
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
        inter = len(self.inter_rows)
        if not dense_mlp:
            expert_key = "moe_intermediate_size" if s.moe_intermediate else "intermediate_size"
            self.expert_full = s.moe_intermediate or s.intermediate
            self.expert_rows = shard.split(self.expert_full, expert_key, s.model_type)
            self.shared_full = s.shared_expert_intermediate
            self.shared_rows = (
                shard.split(self.shared_full, "shared_expert_intermediate_size", s.model_type)
                if self.shared_full else range(0)
            )  # fmt: skip
            moe = MoESpec(
                s.num_experts, s.top_k, len(self.expert_rows), s.norm_topk_prob,
                len(self.shared_rows), s.shared_expert_gate,
            )  # fmt: skip
            self.mlp = SparseMoE(s.hidden, moe, s.act, s.act_field)
        else:
            self.mlp = GatedMLP(s.hidden, inter, s.act, s.act_field, s.mlp_bias)

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
        q, k = apply_rope_owned(q, cos, sin), apply_rope_owned(k, cos, sin)  # q, k: ours
        o = paged_attention(
            q, k, v, kv_cache, layer, batch.slot_mapping, batch.attn,
            window=self.window, scale=self.scale, softcap=self.softcap,
        )  # fmt: skip
        a = self.shard.reduce(self.o_proj(o.reshape(n, -1)))  # [N, hidden]
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            h = self.shard.reduce(self.mlp(self.pre_feedforward_layernorm(x)))
            return x + self.post_feedforward_layernorm(h)
        x, h = self.post_attention_layernorm.add_forward(x, a)  # x + a, norm(x + a)
        return x + self.shard.reduce(self.mlp(h))


class DecoderModel(RaggedModel):
    """Ragged decoder built from a :class:`DecoderSpec`; subclasses implement ``spec_from_config``.

    ``shard`` builds one tensor-parallel rank's part (``num_heads`` / ``num_kv_heads``
    are then this rank's); embeddings, norms and the LM head stay whole.
    """

    supports_tensor_parallel = True
    tied_embedding = "embed_tokens"

    def __init__(self, s: DecoderSpec, shard: TensorShard = NO_SHARD):
        super().__init__()
        self.spec = s
        self.shard = shard
        self.model_type = s.model_type
        self.num_layers = s.num_layers
        heads = shard.heads(s.num_heads, s.num_kv_heads, s.model_type)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            heads.num_heads, heads.num_kv_heads, s.head_dim
        )  # fmt: skip
        self.vocab_size = s.vocab_size
        self.max_positions = s.max_positions
        self.eos_token_ids = list(s.eos_token_ids)
        windows = set(s.layer_windows) if s.layer_windows else {None}
        self.kv_window = windows.pop() if len(windows) == 1 else None
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden)
        self.layers = nn.ModuleList([DecoderLayer(s, i, shard) for i in range(s.num_layers)])
        self.norm = RMSNorm(s.hidden, s.eps, s.norm_offset)
        self.rotary = RotaryEmbedding(s.rope)
        self.tied = s.tied
        self.lm_head = nn.Linear(s.hidden, s.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def config_fields(cls, model_type: str) -> tuple[tuple[str, ...], list[Refusal]]:
        """(config keys the forward honours, refusal rules) of ``model_type``."""
        raise NotImplementedError

    @classmethod
    def spec_from_config(cls, config: dict[str, Any]) -> DecoderSpec:
        """Validate ``config`` (see :mod:`.config_check`) and resolve it to a spec."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any], shard: TensorShard = NO_SHARD) -> DecoderModel:
        return cls(cls.spec_from_config(config), shard)

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # [N, hidden]
        if self.spec.embed_scale is not None:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        x = run_layers(self.layers, x, batch, kv_cache, self.rotary)  # [M, hidden]
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
        if module.startswith("self_attn."):
            return self._map_attention(layer, prefix, module, kind, tensor)
        return self._map_mlp(layer, int(idx), module, kind, tensor)

    def _map_attention(
        self, layer: DecoderLayer, prefix: str, module: str, kind: str, tensor: torch.Tensor
    ) -> list[WeightTarget] | None:
        """q/k/v/o projections: this rank's head rows (o_proj: columns) of each."""
        d, (q, kv) = self.head_dim, layer.split[:2]
        q_full = self.spec.num_heads * d
        kv_full = self.spec.num_kv_heads * d
        q_rows = head_rows(layer.heads.q_heads, d)
        kv_rows = head_rows(layer.heads.kv_heads, d)
        qkv = f"{prefix}qkv_proj.{kind}"
        if module == "self_attn.q_proj":
            return [(qkv, take(tensor, [q_rows], q_full), slice(0, q), False)]
        if module == "self_attn.k_proj":
            return [(qkv, take(tensor, [kv_rows], kv_full), slice(q, q + kv), False)]
        if module == "self_attn.v_proj":
            return [(qkv, take(tensor, [kv_rows], kv_full), slice(q + kv, q + 2 * kv), False)]
        if module == "self_attn.qkv_proj":  # Phi-3: already fused q, k, v
            pieces = [q_rows, _shift(kv_rows, q_full), _shift(kv_rows, q_full + kv_full)]
            return [(qkv, take(tensor, pieces, q_full + 2 * kv_full), None, False)]
        if module == "self_attn.o_proj":
            if kind == "bias":
                return [(f"{prefix}o_proj.bias", self.shard.row_bias(tensor), None, False)]
            return [self.row_parallel(f"{prefix}o_proj.weight", tensor, [q_rows], q_full)]
        return None

    def _map_mlp(
        self, layer: DecoderLayer, idx: int, module: str, kind: str, tensor: torch.Tensor
    ) -> list[WeightTarget] | None:
        mlp = layer.mlp
        if not isinstance(mlp, GatedMLP):
            return self._map_moe(layer, idx, module, kind, tensor)
        target = {
            "mlp.gate_proj": "gate",
            "mlp.up_proj": "up",
            "mlp.gate_up_proj": "gate_up",  # Phi-3: gate then up
            "mlp.down_proj": "down",
        }.get(module)
        if target is None:
            return None
        rows, full = layer.inter_rows, self.spec.intermediate
        return [self._gated_target(f"layers.{idx}.mlp.", target, kind, tensor, rows, full)]

    def _gated_target(
        self, prefix: str, part: str, kind: str, tensor: torch.Tensor, rows: range, full: int
    ) -> WeightTarget:
        """One gated-MLP checkpoint tensor (``part`` gate / up / gate_up / down) of this rank,
        which holds ``rows`` of the MLP's ``full`` intermediate rows."""
        inter = len(rows)
        if part == "down":
            if kind == "bias":
                return (f"{prefix}down_proj.bias", self.shard.row_bias(tensor), None, False)
            return self.row_parallel(f"{prefix}down_proj.weight", tensor, [rows], full)
        gate_up = f"{prefix}gate_up_proj.{kind}"
        if part == "gate":
            return (gate_up, take(tensor, [rows], full), slice(0, inter), False)
        if part == "up":
            return (gate_up, take(tensor, [rows], full), slice(inter, 2 * inter), False)
        return (gate_up, take(tensor, [rows, _shift(rows, full)], 2 * full), None, False)

    _EXPERTS_RE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")

    def _map_experts(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        """transformers >= 5 stores all experts of a layer as one 3-D tensor ``[E, out, in]``;
        only the experts this rank holds are taken."""
        m = self._EXPERTS_RE.match(name)
        if m is None or not self.spec.num_experts:
            return None
        idx, proj = m.groups()
        layer = self.layers[int(idx)]
        if not isinstance(layer.mlp, SparseMoE):
            return None
        part = "gate_up" if proj == "gate_up_proj" else "down"
        rows, full = layer.expert_rows, layer.expert_full
        return [
            self._gated_target(
                f"layers.{idx}.mlp.experts.{e}.", part, "weight", tensor[e], rows, full
            )
            for e in layer.mlp.local_experts
            if e < tensor.shape[0]
        ]

    _EXPERT_PARTS = {
        "w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
        "down_proj": "down",
    }  # fmt: skip

    def _map_moe(
        self, layer: DecoderLayer, idx: int, module: str, kind: str, tensor: torch.Tensor
    ) -> list[WeightTarget] | None:
        """Router, per-expert weights (``block_sparse_moe.experts.{e}.w1/w2/w3`` or
        ``mlp.experts.{e}.gate_proj/up_proj/down_proj``; experts held elsewhere are
        skipped) and the shared expert (``mlp.shared_expert.*``, ``shared_expert_gate``)."""
        module = module.replace("block_sparse_moe.", "mlp.")
        prefix = f"layers.{idx}.mlp."
        if module in ("mlp.gate", "mlp.shared_expert_gate"):
            return [(f"{prefix}{module.removeprefix('mlp.')}.{kind}", tensor, None, False)]
        m = re.match(r"^mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$", module)
        if m is not None:
            e, w = int(m.group(1)), m.group(2)
            if e not in layer.mlp.local_experts:
                return [] if e < self.spec.num_experts else None
            return [
                self._gated_target(
                    f"{prefix}experts.{e}.", self._EXPERT_PARTS[w], kind, tensor,
                    layer.expert_rows, layer.expert_full,
                )
            ]  # fmt: skip
        m = re.match(r"^mlp\.shared_expert\.(gate_proj|up_proj|down_proj)$", module)
        if m is None or layer.mlp.shared_expert is None:
            return None
        return [
            self._gated_target(
                f"{prefix}shared_expert.", self._EXPERT_PARTS[m.group(1)], kind, tensor,
                layer.shared_rows, layer.shared_full,
            )
        ]  # fmt: skip

    def place_experts(self, local_experts: range) -> None:
        """Keep only the experts ``local_experts`` in every routed layer (expert parallelism).

        Call before loading: the checkpoint's other experts are then skipped at load.
        """
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.keep_experts(local_experts)

    def moe_blocks(self) -> list[SparseMoE]:
        """The routed blocks, in layer order."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]


def _shift(rows: range, offset: int) -> range:
    return range(rows.start + offset, rows.stop + offset)


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
