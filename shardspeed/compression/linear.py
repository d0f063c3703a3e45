"""``CompressedLinear`` (``nn.Linear`` + every technique but channel pruning) and
``CompressedEmbedding`` (``nn.Embedding`` + weight quantization).

Pruning shapes for a weight ``(out_features, in_features)``:

* row pruning masks output rows: mask ``(out, 1)``; removing rows shrinks ``out_features``
  and the *related* next layer loses the same input columns;
* head pruning acts on an attention output projection, whose input is ``num_heads`` blocks
  of ``head_dim`` features: mask ``(1, num_heads)`` over the input blocks; removing heads
  shrinks ``in_features`` here and the output rows of the *related* q/k/v projections.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from shardspeed.compression.pruning_mask import ROW, uniform_scores
from shardspeed.compression.quantizers import topk_mask_ste
from shardspeed.compression.technique_state import CompressionState


class CompressedLinear(nn.Linear, CompressionState):
    """``nn.Linear`` with compression techniques; same constructor, forward and state."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self._init_compression_state()
        self.row_pruning_method: str | None = None
        self.row_pruning_ratio = 1.0
        self.row_pruning_enabled = False
        self.head_pruning_method: str | None = None
        self.head_pruning_ratio = 1.0
        self.head_pruning_enabled = False
        self.num_heads = 0

    def extra_repr(self) -> str:
        target = self.weight_bits.target_bits if self.weight_bits else None
        return (
            f"{super().extra_repr()}, sparse pruning={self.sparse_pruning_method is not None}, "
            f"row pruning={self.row_pruning_method is not None}, "
            f"head pruning={self.head_pruning_method is not None}, "
            f"activation quantization={self.activation_quantization_method is not None}, "
            f"weight_quantization={target}"
        )

    # -- row pruning --------------------------------------------------------------------------
    def enable_row_pruning(self, dense_ratio: float, method: str) -> None:
        """l1: keep the rows of largest L1 norm; topk: learned row scores ``(out, 1)``."""
        self.row_pruning_ratio = dense_ratio
        self.row_pruning_method = method
        ranking = None
        if method == "l1":
            ranking = torch.linalg.norm(self.weight.data, ord=1, dim=1).view(-1, 1)  # (out, 1)
        ROW.attach(self, method, dense_ratio, ranking, (self.out_features, 1))

    def row_mask(self) -> torch.Tensor:
        assert self.row_pruning_method is not None
        return ROW.mask(self, self.row_pruning_method, self.row_pruning_ratio)

    def fix_row_pruning(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        """Without ``mask``: fold this layer's row mask (remove the rows when
        ``dim_reduction``, else zero them) and return it. With ``mask`` (a previous layer's
        row mask): remove the matching input columns and return None."""
        if mask is not None:
            self._replace_weight(self.weight.data[:, mask.view(-1)])
            self.in_features = self.weight.size(1)
            self.row_pruning_enabled = False
            return None
        if self.row_pruning_method is None:
            return None
        keep = self.row_mask().data.bool().view(-1)  # (out,)
        if dim_reduction:
            self._replace_weight(self.weight.data[keep, :])
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.data[keep])
            self.out_features = self.weight.size(0)
        else:
            self.weight.data = self.weight.data * keep.view(-1, 1)
            if self.bias is not None:
                self.bias.data = self.bias.data * keep
        ROW.drop(self, self.row_pruning_method)
        self.row_pruning_method = None
        self.row_pruning_enabled = False
        return keep

    # -- head pruning -------------------------------------------------------------------------
    def enable_head_pruning(self, dense_ratio: float, method: str, num_heads: int) -> None:
        """Learned head scores ``(1, num_heads)`` over this output projection's input."""
        if self.in_features % num_heads:
            raise ValueError(
                f"head_pruning.shared_parameters.num_heads={num_heads} does not divide "
                f"in_features={self.in_features} of this layer; allowed: a divisor of "
                f"{self.in_features}. Fix: set num_heads to the attention head count and "
                "list only attention output projections in 'modules'."
            )
        self.num_heads = num_heads
        self.head_pruning_ratio = dense_ratio
        self.head_pruning_method = method
        self.head_pruning_scores = uniform_scores((1, num_heads), self.weight.device)

    def head_mask(self) -> torch.Tensor:
        return topk_mask_ste(self.head_pruning_scores, self.head_pruning_ratio)

    def _mask_heads(self, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        by_head = weight.t().reshape(self.num_heads, -1)  # (H, head_dim * out)
        return (by_head * mask.view(-1, 1)).reshape(in_features, out_features).t()

    def fix_head_pruning(
        self,
        mask: torch.Tensor | None = None,
        num_heads: int | None = None,
        dim_reduction: bool = False,
    ) -> torch.Tensor | None:
        """Without ``mask``: fold the head mask of this output projection (remove the heads'
        input columns when ``dim_reduction``) and return it. With ``mask``: this is a q/k/v
        projection of ``num_heads`` heads; remove the pruned heads' output rows."""
        if mask is not None:
            heads = num_heads or self.num_heads
            keep = mask.view(-1)
            self._replace_weight(
                self.weight.data.reshape(heads, -1)[keep, :].reshape(-1, self.in_features)
            )
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.data.reshape(heads, -1)[keep, :].reshape(-1))
            self.out_features = self.weight.size(0)
            self.head_pruning_enabled = False
            return mask
        if self.head_pruning_method is None:
            return None
        keep = self.head_mask().data.bool()  # (1, H)
        if dim_reduction:
            out_features = self.out_features
            by_head = self.weight.data.t().reshape(self.num_heads, -1)  # (H, head_dim * out)
            self._replace_weight(by_head[keep.view(-1), :].reshape(-1, out_features).t())
            self.in_features = self.weight.size(1)
        else:
            self.weight.data = self._mask_heads(self.weight.data, keep)
        del self.head_pruning_scores
        self.head_pruning_method = None
        self.head_pruning_enabled = False
        return keep

    # -- forward ------------------------------------------------------------------------------
    def compressed_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias this forward multiplies by (quantized and masked as enabled)."""
        weight, bias = self.quantized_weight(self.weight), self.bias
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            weight = weight * self.sparse_mask().view(self.weight.size())
        if self.row_pruning_enabled and self.row_pruning_method:
            mask = self.row_mask()  # (out, 1)
            weight = weight * mask.view(-1, 1)
            if bias is not None:
                bias = bias * mask.view(-1)
        if self.head_pruning_enabled and self.head_pruning_method:
            weight = self._mask_heads(weight, self.head_mask())
        return weight, bias

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.compressed_weight_and_bias()
        # dynamic activation ranges are per token: (..., in) -> numel / in groups
        input = self.quantized_input(input, input.numel() // input.size(-1))
        return F.linear(input, weight, bias)


class CompressedEmbedding(nn.Embedding, CompressionState):
    """``nn.Embedding`` with weight quantization (one scale per token row in forward)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_compression_state()

    def enable_weight_quantization(
        self,
        start_bits: int,
        target_bits: int,
        quantization_period: int,
        in_forward: bool,
        quantization_type: str,
        num_groups: int,
    ) -> None:
        # in forward, an embedding is always quantized token-wise (one group per row)
        groups = self.num_embeddings if in_forward else num_groups
        super().enable_weight_quantization(
            start_bits, target_bits, quantization_period, in_forward, quantization_type, groups
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.quantized_weight(self.weight)
        return F.embedding(
            input,
            weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
