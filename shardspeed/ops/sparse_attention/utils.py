"""``SparseAttentionUtils``: fit a Hugging Face BERT/RoBERTa model with sparse attention.

* ``replace_model_self_attention_with_sparse_self_attention``: swap every encoder layer's
  self-attention for :class:`HFBertSparseSelfAttention`, keeping the trained q/k/v weights;
* ``extend_position_embedding``: tile the position embeddings to a longer maximum length;
* ``pad_to_block_size`` / ``unpad_sequence_output``: make the sequence a whole number of blocks
  before the model and cut the padding off its output.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from shardspeed.ops.sparse_attention.bert_sparse_self_attention import HFBertSparseSelfAttention
from shardspeed.ops.sparse_attention.sparsity_config import SparsityConfig

logger = logging.getLogger(__name__)

# RoBERTa reserves position ids 0 and 1 (padding_idx + 1 is the first real position).
ROBERTA_RESERVED_POSITIONS = 2


def _base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The BERT/RoBERTa base model inside ``model`` (a head model or the base itself)."""
    for prefix in ("bert", "roberta"):
        if hasattr(model, prefix):
            return getattr(model, prefix), prefix
    prefix = getattr(model, "base_model_prefix", None)
    if prefix in ("bert", "roberta") and hasattr(model, "encoder"):
        return model, prefix
    raise ValueError(
        f"{type(model).__name__} is neither a BERT nor a RoBERTa model (no 'bert'/'roberta' "
        "attribute and base_model_prefix not in ('bert', 'roberta')); sparse attention "
        "replacement supports only these two families."
    )


def _resize_position_buffers(embeddings: nn.Module, size: int) -> None:
    """Grow Hugging Face's cached ``position_ids``/``token_type_ids`` buffers to ``size``."""
    for name in ("position_ids", "token_type_ids"):
        buffer = getattr(embeddings, name, None)
        if isinstance(buffer, torch.Tensor) and buffer.dim() == 2 and buffer.shape[1] < size:
            if name == "position_ids":
                grown = torch.arange(size, device=buffer.device, dtype=buffer.dtype).unsqueeze(0)
            else:
                grown = buffer.new_zeros(1, size)
            embeddings.register_buffer(name, grown, persistent=False)


class SparseAttentionUtils:
    """Helpers to adapt a pretrained transformer to block-sparse self-attention."""

    @staticmethod
    def extend_position_embedding(model: nn.Module, max_position: int) -> nn.Module:
        """Tile the learned position embeddings so the model accepts ``max_position`` tokens.

        The original table is repeated (BERT) or its non-reserved rows are (RoBERTa);
        ``model.config.max_position_embeddings`` is updated.
        """
        base, prefix = _base_model(model)
        embedding = base.embeddings.position_embeddings
        weight = embedding.weight
        reserved = ROBERTA_RESERVED_POSITIONS if prefix == "roberta" else 0
        original = weight.shape[0] - reserved
        if max_position <= original:
            raise ValueError(
                f"max_position={max_position} must exceed the current {original} positions; "
                "extend_position_embedding only grows the table."
            )
        learned = weight.data[reserved:]  # (original, hidden)
        repeats = -(-max_position // original)
        tiled = learned.repeat(repeats, 1)[:max_position]  # (max_position, hidden)
        weight.data = torch.cat([weight.data[:reserved], tiled])
        embedding.num_embeddings = weight.shape[0]
        _resize_position_buffers(base.embeddings, weight.shape[0])
        model.config.max_position_embeddings = weight.shape[0]
        logger.info("Extended position embeddings from %d to %d", original, max_position)
        return model

    @staticmethod
    def update_tokenizer_model_max_length(tokenizer: Any, max_position: int) -> Any:
        """Let ``tokenizer`` produce sequences of up to ``max_position`` tokens."""
        tokenizer.model_max_length = max_position
        tokenizer.init_kwargs["model_max_length"] = max_position
        logger.info("Updated tokenizer model_max_length to %d", max_position)
        return tokenizer

    @staticmethod
    def replace_model_self_attention_with_sparse_self_attention(
        model: nn.Module, max_position: int, sparsity_config: SparsityConfig
    ) -> nn.Module:
        """Swap every encoder self-attention of a BERT/RoBERTa ``model`` for sparse attention.

        Sets ``config.max_position_embeddings`` to ``max_position`` (+2 for RoBERTa) so the
        master layout covers it; the trained q/k/v projections are kept.
        """
        base, prefix = _base_model(model)
        reserved = ROBERTA_RESERVED_POSITIONS if prefix == "roberta" else 0
        model.config.max_position_embeddings = max_position + reserved
        SparseAttentionUtils.replace_self_attention_layer_with_sparse_self_attention_layer(
            model.config, base.encoder.layer, sparsity_config
        )
        return model

    @staticmethod
    def replace_self_attention_layer_with_sparse_self_attention_layer(
        config: Any, layers: Any, sparsity_config: SparsityConfig
    ) -> Any:
        """Replace ``layer.attention.self`` of every layer, reusing its q/k/v projections."""
        if sparsity_config.num_heads != config.num_attention_heads:
            raise ValueError(
                f"sparsity_config.num_heads={sparsity_config.num_heads} but the model has "
                f"num_attention_heads={config.num_attention_heads}; build the sparsity config "
                "with the model's head count."
            )
        for layer in layers:
            dense = layer.attention.self
            sparse = HFBertSparseSelfAttention(config, sparsity_config)
            sparse.query, sparse.key, sparse.value = dense.query, dense.key, dense.value
            layer.attention.self = sparse.to(dense.query.weight.device)
        return layers

    @staticmethod
    def pad_to_block_size(
        block_size: int,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        pad_token_id: int,
        model_embeddings: nn.Module | None,
    ) -> tuple[int, Any, Any, Any, Any, Any]:
        """Pad every given input on the sequence dim to a multiple of ``block_size``.

        Padding tokens are ``pad_token_id`` (ids and, as in DeepSpeed, position ids), 0 in the
        attention mask (so no token attends to them) and token type 0; ``inputs_embeds`` are
        extended with ``model_embeddings(pad ids)``. Inputs given as None stay None.

        Returns:
            ``(pad_len, input_ids, attention_mask, token_type_ids, position_ids,
            inputs_embeds)``; pass ``pad_len`` to :meth:`unpad_sequence_output`.
        """
        if input_ids is None and inputs_embeds is None:
            raise ValueError("pad_to_block_size needs input_ids or inputs_embeds.")
        batch, seq_len = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if inputs_embeds is not None:
            if model_embeddings is None:
                raise ValueError(
                    "inputs_embeds needs model_embeddings to embed the padding tokens."
                )
            pad_ids = torch.full(
                (batch, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device
            )
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
        if input_ids is not None:
            input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
        if position_ids is not None:
            position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
        if attention_mask is None:
            device = (input_ids if input_ids is not None else inputs_embeds).device
            attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
        attention_mask = F.pad(attention_mask, (0, pad_len), value=0)
        if token_type_ids is not None:
            token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
        """Drop the ``pad_len`` padding positions from (B, L + pad_len, ...) model output."""
        if pad_len > 0:
            sequence_output = sequence_output[:, :-pad_len]
        return sequence_output
