"""DeepSpeed's ``deepspeed.runtime.zero.tiling``: a ``Linear`` cut into tiles.

``TiledLinear(in_features, out_features, in_splits=I, out_splits=O)`` computes what one
``nn.Linear`` would, with its weight cut into an O x I grid of smaller ``Linear`` tiles::

    weight (out_features, in_features)         x (..., in_features) split on its last dim
    +-----------+-----------+                  into I chunks x_0 .. x_{I-1}
    | tile 0,0  | tile 0,1  |  -> y_0 = sum_i tile[0][i](x_i)     (bias on the last tile)
    +-----------+-----------+
    | tile 1,0  | tile 1,1  |  -> y_1 = sum_i tile[1][i](x_i)
    +-----------+-----------+                  y = cat(y_0, .., y_{O-1}) on the last dim

Tiles live in ``self.linears[out_id][in_id]`` (DeepSpeed's names, so state dicts match).
Under ZeRO-3 every tile is a unit of its own (an element of the row's ``ModuleList``; the
grid of rows is deliberately not a container, see
:func:`shardspeed.zero.unit_sharding.split_units`): the engine gathers one tile at a time
around its forward and backward and releases it after, so a huge projection never needs
its whole weight in memory. (A ``TiledLinear`` inside a larger unit, e.g. a block of the
model's layer list, is gathered with that unit.) Split sizes follow
:func:`shardspeed.runtime.utils.partition_uniform`, as DeepSpeed's do.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from shardspeed.runtime.utils import partition_uniform


def split_tensor_along_last_dim(
    tensor: torch.Tensor, partitions: list[int], contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """``tensor`` cut along its last dim into chunks of the sizes in ``partitions``."""
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


def _check_splits(name: str, splits: int, features: int, features_name: str) -> None:
    if not isinstance(splits, int) or not 1 <= splits <= features:
        raise ValueError(
            f"TiledLinear({name}={splits!r}): must be an int in [1, {features_name}={features}]; "
            f"choose at most one tile per feature."
        )


class _TileRows(nn.Module):
    """The rows of tiles (``ModuleList`` each), indexable like DeepSpeed's
    ``ModuleList`` of rows; not a container itself, so each tile is a stage-3 unit."""

    def __init__(self, rows: list[nn.ModuleList]) -> None:
        super().__init__()
        for i, row in enumerate(rows):
            self.add_module(str(i), row)

    def __getitem__(self, index: int) -> nn.ModuleList:
        return self._modules[str(range(len(self))[index])]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.ModuleList]:
        return iter(self._modules.values())  # type: ignore[arg-type]


class TiledLinear(nn.Module):
    """A drop-in ``nn.Linear`` made of ``out_splits x in_splits`` tiles (module docstring).

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        in_splits, out_splits: number of tiles along the input / output features.
        input_is_already_split: ``forward`` gets a sequence of ``in_splits`` chunks instead
            of one tensor.
        combine_out_splits: ``False`` returns the list of ``out_splits`` output chunks.
        linear_cls: the class of every tile (called ``linear_cls(in, out, bias=..., **kwargs)``).
        init_linear: a ``Linear`` whose weight and bias the tiles copy
            (:meth:`copy_params_from`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type[nn.Module] = nn.Linear,
        init_linear: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        _check_splits("in_splits", in_splits, in_features, "in_features")
        _check_splits("out_splits", out_splits, out_features, "out_features")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(num_items=in_features, num_parts=in_splits)
        self.out_parts = partition_uniform(num_items=out_features, num_parts=out_splits)
        rows = []
        for out_id in range(out_splits):
            out_dim = self.out_parts[out_id + 1] - self.out_parts[out_id]
            row = nn.ModuleList()
            for in_id in range(in_splits):
                in_dim = self.in_parts[in_id + 1] - self.in_parts[in_id]
                has_bias = bias and in_id == in_splits - 1  # the bias is added once per row
                row.append(linear_cls(in_dim, out_dim, bias=has_bias, **kwargs))
            rows.append(row)
        self.linears = _TileRows(rows)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(
                    f"TiledLinear.forward: input_is_already_split=True expects {self.in_splits} "
                    f"input chunks (in_splits), got {len(inputs)}; pass one chunk per input tile."
                )
        else:
            parts = partition_uniform(input_.shape[-1], self.in_splits)
            sizes = [parts[i + 1] - parts[i] for i in range(self.in_splits)]
            inputs = list(self._split_global_input(input_, sizes))
        outputs: list[Any] = []
        for out_id, row in enumerate(self.linears):
            acc = None
            for in_id, tile in enumerate(row):
                acc = self._reduce_local_output(in_id, out_id, acc, tile(inputs[in_id]))
            outputs.append(acc)
        if self.combine_out_splits:
            return self._combine_output_splits(outputs)
        return outputs

    def _split_global_input(self, input: torch.Tensor, split_sizes: list[int]) -> Any:
        """Cut the input along its last dim into ``split_sizes`` (override for other types)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Add tile ``(out_id, in_id)``'s output to the row's running sum."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """Join the rows' outputs on the last dim."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy ``other.weight`` (and ``other.bias``) into the tiles.

        Under ZeRO-3 this is a collective (:class:`~shardspeed.zero.GatheredParameters`
        with ``modifier_rank=0``): data-parallel rank 0's values end up on every rank.
        """
        from shardspeed.zero import GatheredParameters

        weight = getattr(other, "weight", None)
        expected = (self.out_features, self.in_features)
        if weight is None or tuple(weight.shape) != expected:
            shape = None if weight is None else tuple(weight.shape)
            raise ValueError(
                f"TiledLinear.copy_params_from(other): other.weight has shape {shape}, "
                f"expected {expected}; pass a Linear of the same size."
            )
        bias = getattr(other, "bias", None)
        if self.use_bias != (bias is not None) or (
            bias is not None and tuple(bias.shape) != (self.out_features,)
        ):
            raise ValueError(
                f"TiledLinear.copy_params_from(other): this TiledLinear has bias={self.use_bias} "
                f"(shape ({self.out_features},)) but other.bias is "
                f"{None if bias is None else tuple(bias.shape)}; tile a Linear with matching bias."
            )
        for row_id, row in enumerate(self.linears):
            rows = slice(self.out_parts[row_id], self.out_parts[row_id + 1])
            for col_id, tile in enumerate(row):
                cols = slice(self.in_parts[col_id], self.in_parts[col_id + 1])
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[rows, cols])
            last = row[self.in_splits - 1]
            if getattr(last, "bias", None) is not None:
                with GatheredParameters(last.bias, modifier_rank=0):
                    last.bias.copy_(bias[rows])


class TiledLinearReturnBias(TiledLinear):
    """``TiledLinear`` over tiles that return ``(output, bias)`` (Megatron-LM's linears with
    ``skip_bias_add``): outputs are summed per row, the bias is passed through, and both are
    concatenated over rows (the bias is ``None`` when no tile returns one)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise ValueError(
                f"TiledLinearReturnBias: tile ({out_id}, {in_id}) returned {type(new_out).__name__}"
                "; linear_cls must return an (output, bias) pair."
            )
        old_out, old_bias = current_out if current_out is not None else (None, None)
        out, bias = new_out
        out = super()._reduce_local_output(in_id, out_id, old_out, out)
        return out, (old_bias if bias is None else bias)

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        out = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return out, (super()._combine_output_splits(biases) if biases else None)


__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]
