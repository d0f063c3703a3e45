"""What every compressed layer shares: weight quantization, sparse pruning and activation
quantization state, switched on by the scheduler and folded by ``redundancy_clean``.

A compressed layer is its ``torch.nn`` base class (``nn.Linear``, ``nn.Conv2d``, ...) plus
this mixin. ``enable_*`` (called by ``init_compression``) attaches a technique and its
state; the scheduler flips the matching ``*_enabled`` flag once the technique's
``schedule_offset`` is reached; the layer's ``forward`` then applies it; ``fix_*`` (called by
``redundancy_clean``) folds it into plain weights. Buffer and parameter names are
DeepSpeed's (``sparse_pruning_mask``, ``sparse_mask_scores``, ...) so state dicts line up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from shardspeed.compression.pruning_mask import SPARSE
from shardspeed.compression.quantizers import (
    quantize_activation_ste,
    quantize_weight,
    quantize_weight_ste,
)

logger = logging.getLogger(__name__)


@dataclass
class BitSchedule:
    """One weight's place in the start -> target bit schedule (mutated by the scheduler).

    ``bits`` is the current precision; at the quantization step ``period`` it drops by one
    and ``period`` doubles (8 -> 4 bits with period P: 7 at step P, 6 at 2P, 5 at 4P, 4 at 8P).
    """

    bits: int
    target_bits: int
    period: int


class StaticActivationRange(nn.Module):
    """Running min/max of the activations (momentum ``act_range_momentum``), frozen in eval.

    Buffer ``x_min_max``: ``(2,)`` = ``[min, max]``; starts at the first batch's range.
    """

    def __init__(self, quantization_type: str, act_range_momentum: float = 0.95) -> None:
        super().__init__()
        self.quantization_type = quantization_type
        self.act_range_momentum = act_range_momentum
        self.register_buffer("x_min_max", torch.zeros(2))

    def forward(self, x: torch.Tensor, num_bits: int) -> torch.Tensor:
        if self.training:
            x_min, x_max = x.data.min(), x.data.max()
            if self.x_min_max[0] == self.x_min_max[1]:  # first batch
                self.x_min_max[0] = x_min
                self.x_min_max[1] = x_max
            m = self.act_range_momentum
            self.x_min_max[0] = self.x_min_max[0] * m + x_min * (1 - m)
            self.x_min_max[1] = self.x_min_max[1] * m + x_max * (1 - m)
        return quantize_activation_ste(
            x, num_bits, self.quantization_type, 1, self.x_min_max[0], self.x_min_max[1]
        )


class CompressionState:
    """Mixin for ``nn.Module`` subclasses with a ``weight`` (see the module docstring)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def _init_compression_state(self) -> None:
        self.weight_bits: BitSchedule | None = None
        self.weight_quantization_type = "symmetric"
        self.weight_quantize_num_groups = 1
        self.weight_quantization_enabled_in_forward = False
        self.weight_quantization_enabled = False
        self.sparse_pruning_method: str | None = None
        self.sparse_pruning_ratio = 1.0
        self.sparse_pruning_enabled = False
        self.activation_quantization_method: str | None = None
        self.activation_quantization_bits = 8
        self.activation_quantization_enabled = False

    # -- weight quantization -------------------------------------------------------------------
    def enable_weight_quantization(
        self,
        start_bits: int,
        target_bits: int,
        quantization_period: int,
        in_forward: bool,
        quantization_type: str,
        num_groups: int,
    ) -> None:
        """Attach the bit schedule; ``in_forward`` quantizes in each forward (STE)."""
        self.weight_bits = BitSchedule(start_bits, target_bits, quantization_period)
        self.weight_quantization_type = quantization_type
        self.weight_quantize_num_groups = num_groups
        self.weight_quantization_enabled_in_forward = in_forward

    def quantized_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as this forward uses it: quantized at the current bits when enabled."""
        if not (self.weight_quantization_enabled_in_forward and self.weight_quantization_enabled):
            return weight
        assert self.weight_bits is not None
        return quantize_weight_ste(
            weight,
            self.weight_bits.bits,
            self.weight_quantization_type,
            self.weight_quantize_num_groups,
        )

    def fix_weight_quantization(self) -> None:
        """Write the target-bit quantized values into the weight (in-forward mode only; the
        in-place mode already holds quantized values)."""
        if self.weight_bits is None or not self.weight_quantization_enabled_in_forward:
            return
        if self.weight_bits.bits != self.weight_bits.target_bits:
            logger.warning(
                "redundancy_clean: %s trained at %d bits but is fixed at its target %d bits",
                type(self).__name__,
                self.weight_bits.bits,
                self.weight_bits.target_bits,
            )
        self.weight.data = quantize_weight(
            self.weight.data,
            self.weight_bits.target_bits,
            self.weight_quantization_type,
            self.weight_quantize_num_groups,
        )
        self.weight_quantization_enabled_in_forward = False

    # -- sparse pruning -----------------------------------------------------------------------
    def enable_sparse_pruning(self, dense_ratio: float, method: str) -> None:
        """l1: fixed mask of the largest |w|; topk: learned scores (one RNG draw)."""
        self.sparse_pruning_ratio = dense_ratio
        self.sparse_pruning_method = method
        ranking = torch.abs(self.weight.data) if method == "l1" else None
        SPARSE.attach(self, method, dense_ratio, ranking, tuple(self.weight.size()))  # type: ignore[arg-type]

    def sparse_mask(self) -> torch.Tensor:
        assert self.sparse_pruning_method is not None
        return SPARSE.mask(self, self.sparse_pruning_method, self.sparse_pruning_ratio)  # type: ignore[arg-type]

    def fix_sparse_pruning(self) -> None:
        """Multiply the mask into the weight and drop the mask (and scores)."""
        if self.sparse_pruning_method is None:
            return
        self.weight.data = self.weight.data * self.sparse_mask().data
        SPARSE.drop(self, self.sparse_pruning_method)  # type: ignore[arg-type]
        self.sparse_pruning_method = None
        self.sparse_pruning_enabled = False

    # -- activation quantization --------------------------------------------------------------
    def enable_activation_quantization(
        self, bits: int, quantization_type: str, range_calibration: str
    ) -> None:
        """Quantize this layer's input: static (running range) or dynamic (per token/sample)."""
        self.activation_quantization_bits = bits
        self.activation_quantization_type = quantization_type
        self.activation_quantization_method = f"{quantization_type}_{range_calibration}"
        if range_calibration == "static":
            self.activation_quantizer = StaticActivationRange(quantization_type)

    def quantized_input(self, x: torch.Tensor, num_dynamic_groups: int) -> torch.Tensor:
        if not self.activation_quantization_enabled or self.activation_quantization_method is None:
            return x
        bits = self.activation_quantization_bits
        if self.activation_quantization_method.endswith("static"):
            return self.activation_quantizer(x, bits)
        return quantize_activation_ste(
            x, bits, self.activation_quantization_type, num_dynamic_groups
        )

    def _replace_weight(self, data: torch.Tensor) -> None:
        """A new (smaller) weight Parameter; the bit schedule lives on the module, not on it."""
        self.weight = nn.Parameter(data)
