"""What the LayerNorm families (GPT-NeoX, OPT, Falcon) and the shared decoder have in common.

* :func:`run_layers`: embeddings -> every layer -> the rows that need logits;
* :func:`mlp_splits`: how a tensor-parallel rank holds a two-matrix MLP
  (up column-parallel, down row-parallel: one all-reduce after it);
* :func:`attention_output`: paged attention, then the row-parallel output
  projection and its all-reduce.

Each family keeps its own checkpoint names; their layers describe how a rank holds
each projection in a ``splits`` dict (see :meth:`RaggedModel.layer_target`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.attention import paged_attention
from shardspeed.inference.fastgen.models.rope import RotaryEmbedding, forward_seq_lens
from shardspeed.inference.fastgen.models.tp_shard import LinearSplit, TensorShard, column, row

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    batch: RaggedBatch,
    kv_cache: KVCache,
    rotary: RotaryEmbedding | None = None,
) -> torch.Tensor:
    """``x``: ``[N, hidden]`` embedded tokens -> ``[M, hidden]`` rows that need logits.

    With ``rotary`` each layer is called ``layer(x, cos, sin, batch, kv_cache, i)``,
    otherwise ``layer(x, batch, kv_cache, i)``.
    """
    if rotary is None:
        for i, layer in enumerate(layers):
            x = layer(x, batch, kv_cache, i)
        return x[batch.logits_indices]
    seq_lens = forward_seq_lens(batch) if rotary.length_dependent else None
    cos, sin = rotary(batch.positions, x.dtype, seq_lens)  # [N, rot_dim] each
    for i, layer in enumerate(layers):
        x = layer(x, cos, sin, batch, kv_cache, i)
    return x[batch.logits_indices]  # [M, hidden]


def mlp_splits(
    shard: TensorShard, names: tuple[str, str], inter: int, inter_key: str, model_type: str
) -> dict[str, LinearSplit]:
    """``{up: column, down: row}`` for ``names = (up, down)`` over this rank's rows of an MLP
    of width ``inter`` (config key ``inter_key``, named when ``shard`` cannot split it)."""
    up, down = names
    rows = shard.split(inter, inter_key, model_type)
    return {up: column([rows], inter), down: row([rows], inter)}


def attention_output(
    shard: TensorShard,
    out_proj: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    layer: int,
    batch: RaggedBatch,
    scale: float | None = None,
) -> torch.Tensor:
    """``out_proj(attention(q, k, v))`` summed over the ranks: ``[N, hidden]``.

    ``q``: ``[N, H, D]``, ``k`` / ``v``: ``[N, H_kv, D]`` (this rank's heads).
    """
    n = q.shape[0]
    o = paged_attention(q, k, v, kv_cache, layer, batch.slot_mapping, batch.attn, scale=scale)
    return shard.reduce(out_proj(o.reshape(n, -1)))  # [N, H * D] -> [N, hidden]
