"""DeepSpeed's ``deepspeed.compression.basic_layer`` names, with its method names.

``init_compression`` swaps layers for these classes, so a DeepSpeed script's
``isinstance(module, LinearLayer_Compress)`` holds and its direct calls
(``get_mask("row")``, ``fix_row_col_pruning_helper(mask, dim_reduction=True)``,
``forward(x, skip_bias_add=True)``, ``QuantAct(0.95, "symmetric")(x, 8)``) behave as in
DeepSpeed 0.19.6. The work is done by :class:`CompressedLinear` and friends; this file only
maps names.

``ColumnParallelLinear_Compress`` / ``RowParallelLinear_Compress`` (Megatron ``mpu``
layers) are refused at construction: see ``docs/compression.md`` (tensor parallelism).
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed.compression.conv import CompressedBatchNorm2d, CompressedConv2d
from shardspeed.compression.linear import CompressedEmbedding, CompressedLinear
from shardspeed.compression.technique_state import StaticActivationRange


def _unknown_mask(pruning_type: str, allowed: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"get_mask(pruning_type={pruning_type!r}): allowed: {', '.join(allowed)}. Fix: ask for "
        "the mask of a pruning technique this layer supports."
    )


class QuantAct(StaticActivationRange):
    """Static-range activation quantizer: ``QuantAct(act_range_momentum, quant_mode)``,
    called as ``quant_act(x, num_bits, *ignored)`` (DeepSpeed's argument order)."""

    def __init__(self, act_range_momentum: float = 0.95, quant_mode: str = "symmetric") -> None:
        super().__init__(quant_mode, act_range_momentum)
        self.quant_mode = quant_mode

    def forward(self, x: torch.Tensor, num_bits: int, *args: Any) -> torch.Tensor:
        return super().forward(x, num_bits)


class Embedding_Compress(CompressedEmbedding):  # noqa: N801 - DeepSpeed's name
    """``nn.Embedding`` with weight quantization (token-wise in forward)."""


class LinearLayer_Compress(CompressedLinear):  # noqa: N801 - DeepSpeed's name
    """``nn.Linear`` with quantization and sparse / row / head pruning."""

    def get_mask(self, pruning_type: str = "row") -> torch.Tensor:
        """The current 0/1 mask of ``"sparse"``, ``"row"`` or ``"head"`` pruning."""
        if pruning_type == "sparse":
            return self.sparse_mask()
        if pruning_type == "row":
            return self.row_mask()
        if pruning_type == "head":
            return self.head_mask()
        raise _unknown_mask(pruning_type, ("sparse", "row", "head"))

    def fix_sparse_pruning_helper(self) -> None:
        self.fix_sparse_pruning()

    def fix_row_col_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        return self.fix_row_pruning(mask, dim_reduction)

    def fix_head_pruning_helper(
        self,
        mask: torch.Tensor | None = None,
        num_heads: int | None = None,
        dim_reduction: bool = False,
    ) -> torch.Tensor | None:
        return self.fix_head_pruning(mask, num_heads, dim_reduction)

    def head_pruning_reshape(self, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``w`` with the input blocks of the heads ``mask`` drops zeroed."""
        return self._mask_heads(w, mask)

    def forward(  # type: ignore[override]
        self, input: torch.Tensor, skip_bias_add: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """``skip_bias_add=True`` returns ``(x @ W.T, bias)`` (Megatron's convention)."""
        if not skip_bias_add:
            return super().forward(input)
        weight, bias = self.compressed_weight_and_bias()
        input = self.quantized_input(input, input.numel() // input.size(-1))
        return torch.nn.functional.linear(input, weight, None), bias


class Conv2dLayer_Compress(CompressedConv2d):  # noqa: N801 - DeepSpeed's name
    """``nn.Conv2d`` with quantization and sparse / channel pruning."""

    def get_mask(self, pruning_type: str = "sparse") -> torch.Tensor:
        """The current 0/1 mask of ``"sparse"`` or ``"channel"`` pruning."""
        if pruning_type == "sparse":
            return self.sparse_mask()
        if pruning_type == "channel":
            return self.channel_mask()
        raise _unknown_mask(pruning_type, ("sparse", "channel"))

    def fix_sparse_pruning_helper(self) -> None:
        self.fix_sparse_pruning()

    def fix_channel_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = False
    ) -> torch.Tensor | None:
        return self.fix_channel_pruning(mask, dim_reduction)


class BNLayer_Compress(CompressedBatchNorm2d):  # noqa: N801 - DeepSpeed's name
    """``nn.BatchNorm2d`` that drops the channels a preceding conv pruned."""

    def fix_channel_pruning_helper(
        self, mask: torch.Tensor | None = None, dim_reduction: bool = True
    ) -> torch.Tensor | None:
        return self.fix_channel_pruning(mask, dim_reduction)


class _TensorParallelCompress(LinearLayer_Compress):
    def __init__(self, mpu: Any, *args: Any, **kwargs: Any) -> None:
        raise ValueError(
            f"{type(self).__name__}(mpu={type(mpu).__name__}, ...): compression of "
            "Megatron tensor-parallel linears is not implemented (each rank would rank and "
            "quantize only its slice, so masks and scales would differ from the unsliced "
            "layer's); allowed: LinearLayer_Compress. Fix: compress the unsliced model with "
            "mpu=None, redundancy_clean it, then shard it for inference."
        )


class ColumnParallelLinear_Compress(_TensorParallelCompress):  # noqa: N801
    """Refused: see :class:`_TensorParallelCompress`."""


class RowParallelLinear_Compress(_TensorParallelCompress):  # noqa: N801
    """Refused: see :class:`_TensorParallelCompress`."""


__all__ = [
    "BNLayer_Compress",
    "ColumnParallelLinear_Compress",
    "Conv2dLayer_Compress",
    "Embedding_Compress",
    "LinearLayer_Compress",
    "QuantAct",
    "RowParallelLinear_Compress",
]
