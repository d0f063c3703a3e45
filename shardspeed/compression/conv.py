"""``CompressedConv2d`` (``nn.Conv2d`` + sparse / channel pruning, quantization) and
``CompressedBatchNorm2d`` (the related module that loses a pruned conv's channels).

Channel pruning masks whole output channels: weight ``(out, in / groups, kh, kw)``, mask
``(out, 1, 1, 1)`` ranked by the L1 norm of each kernel (l1) or by learned scores (topk).
Removing channels shrinks this conv's ``out_channels`` and, through ``related_modules``, the
next BatchNorm's features and the next conv's input channels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardspeed.compression.pruning_mask import CHANNEL
from shardspeed.compression.technique_state import CompressionState


class CompressedConv2d(nn.Conv2d, CompressionState):
    """``nn.Conv2d`` with compression techniques; same constructor, forward and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_compression_state()
        self.channel_pruning_method: str | None = None
        self.channel_pruning_ratio = 1.0
        self.channel_pruning_enabled = False

    def enable_weight_quantization(
        self,
        start_bits: int,
        target_bits: int,
        quantization_period: int,
        in_forward: bool,
        quantization_type: str,
        num_groups: int,
    ) -> None:
        if in_forward and target_bits < 4:
            raise ValueError(
                f"weight_quantization target_bits={target_bits} with "
                "quantize_weight_in_forward=true on a Conv2d; allowed: target_bits >= 4 for "
                "convolutions quantized in forward. Fix: raise target_bits, set "
                "quantize_weight_in_forward to false, or leave convolutions out of 'modules'."
            )
        super().enable_weight_quantization(
            start_bits, target_bits, quantization_period, in_forward, quantization_type, num_groups
        )

    def enable_channel_pruning(self, dense_ratio: float, method: str) -> None:
        """l1: keep the output channels of largest kernel L1 norm; topk: learned scores."""
        self.channel_pruning_ratio = dense_ratio
        self.channel_pruning_method = method
        ranking = None
        if method == "l1":
            # L1 norm of each kernel (DeepSpeed's linalg.norm(ord=1, dim=[1, 2, 3]) raises)
            ranking = self.weight.data.abs().sum(dim=(1, 2, 3)).view(-1, 1, 1, 1)  # (out,1,1,1)
        CHANNEL.attach(self, method, dense_ratio, ranking, (self.out_channels, 1, 1, 1))

    def channel_mask(self) -> torch.Tensor:
        assert self.channel_pruning_method is not None
        return CHANNEL.mask(self, self.channel_pruning_method, self.channel_pruning_ratio)

    def fix_channel_pruning(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        """Without ``mask``: fold this conv's channel mask (remove the channels when
        ``dim_reduction``) and return it. With ``mask``: remove those input channels."""
        if mask is not None:
            self._replace_weight(self.weight.data[:, mask.view(-1), ...])
            self.in_channels = self.weight.size(1) * self.groups
            self.channel_pruning_enabled = False
            return None
        if self.channel_pruning_method is None:
            return None
        keep = self.channel_mask().data.bool().view(-1)  # (out,)
        if dim_reduction:
            self._replace_weight(self.weight.data[keep, ...])
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.data[keep])
            self.out_channels = self.weight.size(0)
        else:
            self.weight.data = self.weight.data * keep.view(-1, 1, 1, 1)
            if self.bias is not None:
                self.bias.data = self.bias.data * keep
        CHANNEL.drop(self, self.channel_pruning_method)
        self.channel_pruning_method = None
        self.channel_pruning_enabled = False
        return keep

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.quantized_weight(self.weight), self.bias
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            weight = weight * self.sparse_mask().view(self.weight.size())
        if self.channel_pruning_enabled and self.channel_pruning_method:
            mask = self.channel_mask()  # (out, 1, 1, 1)
            weight = weight * mask.view(-1, 1, 1, 1)
            if bias is not None:
                bias = bias * mask.view(-1)
        # dynamic activation ranges are per sample: (N, C, H, W) -> N groups
        input = self.quantized_input(input, input.numel() // input[0].numel())
        return self._conv_forward(input, weight, bias)


class CompressedBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that can drop the channels a preceding conv pruned."""

    def fix_channel_pruning(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = True
    ) -> torch.Tensor | None:
        if mask is None:
            return None
        keep = mask.view(-1)
        if self.weight is not None:
            self.weight = nn.Parameter(self.weight.data[keep])
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data[keep])
        if self.running_mean is not None:
            self.running_mean = self.running_mean[keep]
        if self.running_var is not None:
            self.running_var = self.running_var[keep]
        self.num_features = int(keep.sum())
        return None


__all__ = ["CompressedBatchNorm2d", "CompressedConv2d"]
