"""Base class of models that run one ragged forward over a blocked KV cache."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.models.rope import RotaryEmbedding
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD, LinearSplit, TensorShard, take
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch

logger = get_logger(__name__)

# (our parameter name, source tensor, rows of our parameter it fills or None for all, transpose)
WeightTarget = tuple[str, torch.Tensor, slice | None, bool]
# (our parameter name, the whole checkpoint weight (out, in), the input columns this rank holds)
RowParallelHook = Callable[[str, torch.Tensor, list[range]], None]


class RaggedModel(nn.Module):
    """A decoder-only LM whose ``forward(batch, kv_cache)`` returns ``[M, vocab]`` logits.

    Subclasses set the shape attributes below in ``__init__``, implement
    :meth:`from_config` (HF ``config.json`` dict -> model) and :meth:`map_weight`
    (checkpoint tensor name -> where it goes); :meth:`load_weights` does the
    copying and checks that every parameter was filled.

    Families with ``supports_tensor_parallel`` also take ``from_config(config,
    shard)`` with a :class:`~.tp_shard.TensorShard` and then build, load (slicing in
    ``map_weight``) and run one tensor-parallel rank's part; ``num_heads`` and
    ``num_kv_heads`` are this rank's (what its KV cache holds).
    """

    model_type: str = ""
    supports_tensor_parallel: bool = False
    shard: TensorShard = NO_SHARD
    num_layers: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    vocab_size: int
    max_positions: int | None  # None => no hard limit (RoPE)
    learned_positions: bool = False  # True => max_positions is a hard limit
    # Set when *every* layer attends only to the last ``kv_window`` tokens: KV blocks that
    # end before ``num_computed_tokens - kv_window + 1`` are never read again; the
    # scheduler frees them (``Scheduler._release_window``).
    kv_window: int | None = None
    eos_token_ids: list[int]
    tied_embedding: str = ""  # the embedding a tied LM head shares its weight with (``tied``)
    # Called with every whole row-parallel weight as it loads (the loader quantizes it
    # whole there and keeps this rank's columns); None: nothing to do.
    row_parallel_hook: RowParallelHook | None = None

    @property
    def rope_recompute_len(self) -> int | None:
        """Sequence length at which keys cached for a shorter length must be recomputed
        (longrope: ``original_max_position_embeddings + 1``, as HF's Phi-3 ``generate``
        drops its cache there); None when cached keys never go stale."""
        rotary = getattr(self, "rotary", None)
        return rotary.recompute_len if isinstance(rotary, RotaryEmbedding) else None

    def kv_rope_key(self, rope_base_len: int) -> bytes:
        """What a sequence's cached keys depend on besides its tokens, given its
        ``rope_base_len`` (length-dependent RoPE); keys the prefix-cache hash chain."""
        rotary = getattr(self, "rotary", None)
        return rotary.cache_key(rope_base_len) if isinstance(rotary, RotaryEmbedding) else b""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RaggedModel:
        raise NotImplementedError

    def map_weight(self, name: str, tensor: torch.Tensor) -> list[WeightTarget] | None:
        """Where checkpoint tensor ``name`` goes; ``[]`` to skip it, None if unknown."""
        raise NotImplementedError

    def forward(self, batch: RaggedBatch, kv_cache: KVCache) -> torch.Tensor:
        raise NotImplementedError

    # ---------------------------------------------------------- tensor-parallel slicing
    def row_parallel(
        self, name: str, tensor: torch.Tensor, pieces: list[range], full: int
    ) -> WeightTarget:
        """Parameter ``name`` holds input columns ``pieces`` of the ``(out, full)`` ``tensor``."""
        hook = self.row_parallel_hook
        if hook is not None and tensor.dim() == 2 and tensor.shape[1] == full:
            param = self.get_parameter(name)  # quantized from the dtype tp=1 would hold
            hook(name, tensor.to(device=param.device, dtype=param.dtype), list(pieces))
        return (name, take(tensor, pieces, full, dim=1), None, False)

    def split_target(
        self, name: str, tensor: torch.Tensor, split: LinearSplit | None
    ) -> WeightTarget:
        """This rank's part of checkpoint ``tensor`` for parameter ``name`` of a layer held as
        ``split`` (None: whole). A row-parallel bias is added once, by rank 0."""
        if split is None or not self.shard.sharded:
            return (name, tensor, None, False)
        if split.kind == "column":
            return (name, take(tensor, split.pieces, split.full), None, False)
        if name.endswith(".bias"):
            return (name, self.shard.row_bias(tensor), None, False)
        return self.row_parallel(name, tensor, list(split.pieces), split.full)

    def layer_target(
        self, prefix: str, layers: nn.ModuleList, match: re.Match[str], tensor: torch.Tensor
    ) -> list[WeightTarget] | None:
        """Target of a per-layer tensor whose name ``match`` split into (layer index, module,
        ``weight``/``bias``); the layer's ``splits`` dict says how a rank holds each module."""
        idx, module, kind = match.groups()
        layer = layers[int(idx)]
        if not hasattr(layer, module):
            return None
        split = getattr(layer, "splits", {}).get(module)
        return [self.split_target(f"{prefix}.{idx}.{module}.{kind}", tensor, split)]

    def tie_weights(self) -> None:
        """Re-share tied parameters (``to_empty`` after meta init unties them)."""
        if getattr(self, "tied", False):
            self.lm_head.weight = self.get_submodule(self.tied_embedding).weight

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into this model; ``ValueError`` on shape mismatch or gaps."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        unexpected = []
        for name, tensor in weights:
            targets = self.map_weight(name, tensor)
            if targets is None:
                unexpected.append(name)
                continue
            for pname, src, rows, transpose in targets:
                param = params[pname]
                src = src.t() if transpose else src
                dst = param[rows] if rows is not None else param
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(src.shape)} but "
                        f"{pname!r}{'' if rows is None else f'[{rows.start}:{rows.stop}]'} "
                        f"expects {tuple(dst.shape)}; does config.json match the weights?"
                    )
                dst.copy_(src)
                rows_filled[pname] += dst.shape[0] if dst.dim() else 1
        if unexpected:
            logger.warning(
                "ignored %d unexpected checkpoint tensors, e.g. %s", len(unexpected), unexpected[:3]
            )
        missing = [n for n, p in params.items() if rows_filled[n] < (p.shape[0] if p.dim() else 1)]
        if missing:
            raise ValueError(
                f"checkpoint is missing weights for {len(missing)} parameters, e.g. {missing[:5]}; "
                "check that the directory holds every *.safetensors shard."
            )
