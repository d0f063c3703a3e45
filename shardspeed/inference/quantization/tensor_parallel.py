"""Quantization of a tensor-parallel rank's layers: the same integers and scales as one rank.

Column-parallel layers hold whole output rows, and every scale belongs to one row,
so quantizing a rank's rows gives exactly the rows of the whole weight's
quantization. Row-parallel layers hold a slice of the *input* columns: quantized
locally, a per-output-channel scale would see only that slice. So their weights are
quantized whole, once, as the checkpoint streams past, and the rank keeps its
column slice of the integers, scales and zero points
(:func:`~.qtensor.slice_quantized`); group-wise weights need every cut on a group
boundary, which :func:`check_group_alignment` verifies before any worker starts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardspeed.inference.quantization.config import WeightQuantConfig
from shardspeed.inference.quantization.qtensor import (
    QuantizedWeight,
    quantize_weight,
    slice_quantized,
)
from shardspeed.inference.quantization.replace import select_layers


class RowParallelQuantizer:
    """Collects this rank's quantized column slices of row-parallel weights.

    Called (as a model's ``row_parallel_hook``) with each full row-parallel weight
    while it loads; :attr:`slices` then maps layer names to the
    :class:`~.qtensor.QuantizedWeight` to pass to ``quantize_model(prequantized=)``.
    """

    def __init__(self, config: WeightQuantConfig) -> None:
        self.config = config
        self.slices: dict[str, QuantizedWeight] = {}

    def __call__(self, param_name: str, full: torch.Tensor, pieces: list[range]) -> None:
        """``full``: the ``(out, in)`` checkpoint weight of ``param_name``; ``pieces``: the
        input columns this rank holds."""
        layer = param_name.removesuffix(".weight")
        if not self.config.selects(layer):
            return
        c = self.config
        qw = quantize_weight(full, c.bits, c.effective_group_size, c.symmetric)
        self.slices[layer] = slice_quantized(qw, pieces, dim=1, name=layer)


def check_group_alignment(model: nn.Module, config: WeightQuantConfig, world_size: int) -> None:
    """``ValueError`` unless every layer ``config`` quantizes in one rank's ``model`` (built
    for ``tensor_parallel=world_size``) holds whole groups of input columns.

    A rank's row-parallel layers hold ``in_features`` contiguous columns starting at
    ``rank * in_features``, so the cuts fall on group boundaries exactly when
    ``in_features`` is a multiple of the group size.
    """
    group_size = config.effective_group_size
    if group_size is None:  # per output channel: any cut keeps the row's scale
        return
    for name, module in select_layers(model, config):
        k = module.weight.shape[1]
        if k % group_size:
            raise ValueError(
                f"quantization group_size={group_size} with tensor_parallel={world_size}: layer "
                f"{name!r} holds {k} input columns per rank, not a multiple of the group size; "
                "use a group_size that divides it, another tensor_parallel, or add the layer "
                "to skip_modules."
            )
