"""``BertSparseSelfAttention``: BERT's self-attention (q/k/v projections) over sparse blocks.

:class:`BertSparseSelfAttention` keeps DeepSpeed's calling convention (returns the context
tensor). :class:`HFBertSparseSelfAttention` is the drop-in for a Hugging Face
``BertSelfAttention``/``RobertaSelfAttention`` that ``SparseAttentionUtils`` installs: it
accepts the keyword arguments Hugging Face passes and returns ``(context, None)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed.ops.sparse_attention.sparse_self_attention import (
    SparseSelfAttention,
    mask_to_bias,
)
from shardspeed.ops.sparse_attention.sparsity_config import FixedSparsityConfig, SparsityConfig

DEEPSPEED_MAX_SEQ_LENGTH = 2048
"""DeepSpeed's master-layout length; kept so its checkpoints' ``master_layout`` shapes load."""


class BertSparseSelfAttention(nn.Module):
    """Query/key/value projections of a BERT layer followed by :class:`SparseSelfAttention`.

    Args:
        config: a BERT config (``hidden_size``, ``num_attention_heads``; optional
            ``max_position_embeddings`` raises the master layout above 2048 tokens).
        sparsity_config: the layout; default ``FixedSparsityConfig(num_attention_heads)``.
    """

    def __init__(self, config: Any, sparsity_config: SparsityConfig | None = None):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads="
                f"{config.num_attention_heads}; every head needs the same head size."
            )
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=config.num_attention_heads)
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

        max_seq_length = max(
            DEEPSPEED_MAX_SEQ_LENGTH, getattr(config, "max_position_embeddings", 0) or 0
        )
        max_seq_length -= max_seq_length % sparsity_config.block
        self.sparse_self_attention = SparseSelfAttention(
            sparsity_config, max_seq_length=max_seq_length
        )

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        # (B, L, H*D) -> (B, H, L, D)
        x = x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size)
        return x.permute(0, 2, 1, 3)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Context (B, L, hidden) for ``hidden_states`` (B, L, hidden).

        ``attention_mask`` may be a key-padding mask, (B, L) or BERT's extended (B, 1, 1, L),
        applied in the attention's ``key_padding_mask_mode`` (``"add"``, as DeepSpeed); or a
        full (B|1, 1|H, L, L) mask as recent Hugging Face versions build it: boolean (True
        keeps) or additive float.
        """
        query = self.transpose_for_scores(self.query(hidden_states))  # (B, H, L, D)
        key = self.transpose_for_scores(self.key(hidden_states))
        value = self.transpose_for_scores(self.value(hidden_states))
        seq_len = hidden_states.shape[1]

        if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[2] > 1:
            if attention_mask.shape[2] != seq_len:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; a 4-D mask must be "
                    f"(B|1, 1|H, L, L) with L={seq_len}."
                )
            mode = "mul" if attention_mask.dtype == torch.bool else "add"
            context = self.sparse_self_attention.attend(
                query, key, value, attn_bias=mask_to_bias(attention_mask, mode)
            )
        else:
            context = self.sparse_self_attention(query, key, value, key_padding_mask=attention_mask)
        # (B, H, L, D) -> (B, L, H*D)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.all_head_size)


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """:class:`BertSparseSelfAttention` with Hugging Face's self-attention call convention.

    Accepts (and ignores) the extra arguments Hugging Face passes; cross-attention and
    cached decoding are refused. Returns ``(context, None)``: no attention probabilities.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # transformers 4.x passes (head_mask, encoder_hidden_states, encoder_attention_mask,
        # past_key_value, output_attentions) positionally; 5.x passes keywords.
        cross = kwargs.get("encoder_hidden_states")
        cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("past_key_value")))
        if len(args) > 1:
            cross = cross if cross is not None else args[1]
        if len(args) > 3:
            cache = cache if cache is not None else args[3]
        if cross is not None or cache is not None:
            raise ValueError(
                "Sparse self-attention replaces encoder self-attention only; cross-attention "
                "(encoder_hidden_states) and cached decoding are not supported."
            )
        return super().forward(hidden_states, attention_mask), None
