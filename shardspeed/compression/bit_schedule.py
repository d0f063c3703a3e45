"""The start -> target bit schedule of weight quantization (DeepSpeed's MoQ rule).

One call of :meth:`WeightBitSchedule.step` is one quantization step (the engine makes one
after each applied optimizer step once weight quantization is on, and one before the first
forward). Each step first moves every scheduled weight along its :class:`BitSchedule` (one
bit lower when the step count reaches the weight's period, which then doubles), then, unless
the weights are quantized in forward, writes the quantized values into the weights:

* >= 3 bits: uniform, per ``quantize_groups`` group, nearest or stochastic rounding (one
  uniform draw in [-0.5, 0.5) per element from the global RNG);
* 2 / 1 bits: ternary / binary;
* ``fp16_mixed_quantize``: ``ratio * w + (1 - ratio) * q(w)``, the float share ``ratio``
  falling by ``quantize_change_ratio`` per step and reset to 1 at every bit drop.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardspeed.compression.quantizers import quantize_weight
from shardspeed.compression.technique_state import CompressionState
from shardspeed.config.compression import WeightQuantizationShared

logger = logging.getLogger(__name__)


class WeightBitSchedule:
    """Steps the bit schedule of every weight-quantized module of ``model``."""

    def __init__(self, model: nn.Module, shared: WeightQuantizationShared) -> None:
        self.model = model
        self.shared = shared
        self.num_steps = 0
        self.float_ratio = 1.0

    def _scheduled(self) -> list[CompressionState]:
        """Weight-quantized modules in the order of ``model.parameters()``."""
        by_weight = {
            id(m.weight): m
            for m in self.model.modules()
            if isinstance(m, CompressionState) and m.weight_bits is not None
        }
        return [by_weight[id(p)] for p in self.model.parameters() if id(p) in by_weight]

    def step(self) -> None:
        """One quantization step (see the module docstring)."""
        self.num_steps += 1
        mixed = self.shared.fp16_mixed_quantize
        if mixed.enabled:
            ratio = self.float_ratio  # may dip below 0 for one step, then is held at 0
            self.float_ratio = ratio - mixed.quantize_change_ratio if ratio > 0 else 0.0
        for module in self._scheduled():
            self._advance(module)
            if not module.weight_quantization_enabled_in_forward:
                module.weight.data.copy_(
                    self._quantize(module)
                )  # in place: may be a view of a flat buffer

    def _advance(self, module: CompressionState) -> None:
        bits = module.weight_bits
        assert bits is not None
        if bits.bits != bits.target_bits and self.num_steps >= bits.period:
            self.float_ratio = 1.0
            bits.period <<= 1
            bits.bits -= 1
            if self.shared.quantize_verbose:
                logger.info(
                    "weight quantization: %s now %d bits (step %d, next drop at %d)",
                    type(module).__name__,
                    bits.bits,
                    self.num_steps,
                    bits.period,
                )

    def _quantize(self, module: CompressionState) -> torch.Tensor:
        bits = module.weight_bits
        assert bits is not None
        weight = module.weight.data
        groups = module.weight_quantize_num_groups
        noise = None
        if self.shared.rounding == "stochastic" and bits.bits >= 3:
            noise = weight.new(weight.reshape(groups, -1).shape).uniform_(-0.5, 0.5)
        quantized = quantize_weight(
            weight, bits.bits, self.shared.quantization_type, groups, noise=noise
        )
        if self.shared.fp16_mixed_quantize.enabled and bits.bits >= bits.target_bits - 1:
            quantized = self.float_ratio * weight + (1 - self.float_ratio) * quantized
        return quantized
