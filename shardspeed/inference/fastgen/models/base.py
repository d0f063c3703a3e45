"""Base class of models that run one ragged forward over a blocked KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.models.rope import RotaryEmbedding
from shardspeed.inference.fastgen.models.tp_shard import NO_SHARD, TensorShard
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.kv_cache import KVCache
    from shardspeed.inference.fastgen.ragged import RaggedBatch

logger = get_logger(__name__)

# (our parameter name, source tensor, rows of our parameter it fills or None for all, transpose)
WeightTarget = tuple[str, torch.Tensor, slice | None, bool]


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

    def tie_weights(self) -> None:
        """Re-share tied parameters (``to_empty`` after meta init unties them)."""

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
