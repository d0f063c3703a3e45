"""Megatron-style tensor-parallel layers in pure PyTorch (any backend).

* :class:`ColumnParallelLinear`: the output features are split; ``y_r = x W_r^T + b_r``.
  The input is replicated (its gradient is all-reduced), or, with ``sequence_parallel``,
  sharded by tokens and all-gathered. ``gather_output`` all-gathers the full output.
* :class:`RowParallelLinear`: the input features are split; ``y = sum_r x_r W_r^T + b``
  (all-reduce, or reduce-scatter by tokens with ``sequence_parallel``); the bias is
  replicated and added once, after the reduction.
* :class:`VocabParallelEmbedding`: the vocabulary rows are split; each rank looks up the
  tokens it owns, zeros the rest, and the partial embeddings are all-reduced.

Weights keep the layout of the module they replace (``nn.Linear``: ``(out, in)``; Hugging
Face ``Conv1D``: ``(in, out)``) and the names ``weight``/``bias``, so a sharded model's
``state_dict`` keys are unchanged. Every sharded parameter carries Megatron's marks
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) and its full
:class:`~.partition.ShardLayout` as ``tp_layout``; replicated ones (a row-parallel bias)
carry nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed import comm
from shardspeed.parallel.tensor.comm_ops import (
    copy_to_tensor_region,
    gather_from_sequence_region,
    gather_from_tensor_region,
    reduce_from_tensor_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tensor_region,
)
from shardspeed.parallel.tensor.groups import default_tensor_group
from shardspeed.parallel.tensor.partition import ShardLayout, even_split, slice_shard


def mark_tensor_parallel(param: nn.Parameter, layout: ShardLayout) -> nn.Parameter:
    """Tag ``param`` as this rank's shard of a tensor split by ``layout``."""
    param.tensor_model_parallel = True
    param.partition_dim = layout.dim
    param.partition_stride = layout.num_sub
    param.tp_layout = layout
    return param


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (a linear layer with an ``(in, out)`` weight)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _shard_param(
    full: torch.Tensor, layout: ShardLayout, rank: int, requires_grad: bool
) -> nn.Parameter:
    shard = nn.Parameter(slice_shard(full.detach(), layout, rank), requires_grad=requires_grad)
    return mark_tensor_parallel(shard, layout)


def _full_linear(
    in_features: int, out_features: int, bias: bool, device: Any, dtype: Any
) -> nn.Linear:
    """A full ``nn.Linear`` with torch's default init (the same on every rank for one seed)."""
    return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


class _TensorParallelLinear(nn.Module):
    """Shared state: the group, the split, and the weight layout of the replaced module."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, group: Any, layout: ShardLayout, transposed: bool) -> None:
        super().__init__()
        self.group = default_tensor_group() if group is None else group
        self.tp_size = comm.get_world_size(self.group)
        self.tp_rank = comm.get_rank(self.group)
        if layout.tp_size != self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: the shard layout is for {layout.tp_size} ranks but the "
                f"tensor group has {self.tp_size}; build the layout with the group's size."
            )
        self.layout = layout  # the split dim of the weight, in nn.Linear (out, in) terms
        self.transposed = transposed  # True: the weight is stored (in, out) like HF Conv1D

    def _weight_dim(self, linear_dim: int) -> int:
        """The dim of the stored weight that is ``linear_dim`` of an (out, in) weight."""
        return 1 - linear_dim if self.transposed else linear_dim

    def linear_weight(self) -> torch.Tensor:
        """The weight as (out, in) for ``F.linear`` (a view for Conv1D layouts)."""
        return self.weight.t() if self.transposed else self.weight

    def extra_repr(self) -> str:
        return (
            f"shard={tuple(self.weight.shape)}, tp={self.tp_rank}/{self.tp_size}, "
            f"bias={self.bias is not None}, conv1d_layout={self.transposed}"
        )


class ColumnParallelLinear(_TensorParallelLinear):
    """Linear layer whose output features are split over the tensor axis."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        group: Any = None,
        sequence_parallel: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        """Initialise like ``nn.Linear`` on the full weight, keep this rank's rows (even split)."""
        full = _full_linear(in_features, out_features, bias, device, dtype)
        group = default_tensor_group() if group is None else group
        layout = ShardLayout.of(0, even_split(out_features, comm.get_world_size(group)))
        self._init_from(
            full.weight, full.bias, layout, group, gather_output, sequence_parallel, False
        )

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        layout: ShardLayout,
        *,
        group: Any = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> ColumnParallelLinear:
        """Shard an ``nn.Linear`` / ``Conv1D`` by ``layout`` (dim 0 = its output features)."""
        self = cls.__new__(cls)
        self._init_from(
            module.weight,
            module.bias,
            layout,
            group,
            gather_output,
            sequence_parallel,
            is_conv1d(module),
        )
        return self

    def _init_from(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layout: ShardLayout,
        group: Any,
        gather_output: bool,
        sequence_parallel: bool,
        transposed: bool,
    ) -> None:
        assert layout.dim == 0, "a column-parallel layout splits the output features (dim 0)"
        _TensorParallelLinear.__init__(self, group, layout, transposed)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = 1  # (B, T, H) activations, as Hugging Face models use
        weight_layout = layout.with_dim(self._weight_dim(0))
        self.weight = _shard_param(weight, weight_layout, self.tp_rank, weight.requires_grad)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _shard_param(bias, layout.with_dim(0), self.tp_rank, bias.requires_grad)
        self.in_features = weight.shape[self._weight_dim(1)]
        self.out_features = layout.full_size

    @property
    def output_range(self) -> tuple[int, int]:
        """[start, stop) of this rank's output features (plain, unfused layouts)."""
        (start_stop,) = self.layout.ranges(self.tp_rank)
        return start_stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, in) replicated, or (B, T / tp, in) with sequence_parallel
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.group, self.sequence_dim)  # (B, T, in)
        else:
            x = copy_to_tensor_region(x, self.group)
        y = F.linear(x, self.linear_weight(), self.bias)  # (B, T, out / tp)
        if self.gather_output:
            y = gather_from_tensor_region(y, self.group, self.layout)  # (B, T, out)
        return y


class RowParallelLinear(_TensorParallelLinear):
    """Linear layer whose input features are split over the tensor axis."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        group: Any = None,
        sequence_parallel: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        """Initialise like ``nn.Linear`` on the full weight, keep this rank's columns."""
        full = _full_linear(in_features, out_features, bias, device, dtype)
        group = default_tensor_group() if group is None else group
        layout = ShardLayout.of(1, even_split(in_features, comm.get_world_size(group)))
        self._init_from(
            full.weight, full.bias, layout, group, input_is_parallel, sequence_parallel, False
        )

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        layout: ShardLayout,
        *,
        group: Any = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> RowParallelLinear:
        """Shard an ``nn.Linear`` / ``Conv1D`` by ``layout`` (dim 1 = its input features)."""
        self = cls.__new__(cls)
        self._init_from(
            module.weight, module.bias, layout, group, input_is_parallel, sequence_parallel,
            is_conv1d(module),
        )  # fmt: skip
        return self

    def _init_from(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layout: ShardLayout,
        group: Any,
        input_is_parallel: bool,
        sequence_parallel: bool,
        transposed: bool,
    ) -> None:
        assert layout.dim == 1, "a row-parallel layout splits the input features (dim 1)"
        _TensorParallelLinear.__init__(self, group, layout, transposed)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = 1
        self.weight = _shard_param(
            weight, layout.with_dim(self._weight_dim(1)), self.tp_rank, weight.requires_grad
        )
        if bias is None:
            self.register_parameter("bias", None)
        else:  # replicated: added once after the reduction, identical on every tensor rank
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
            if sequence_parallel:  # added to this rank's tokens only: a partial gradient
                self.bias.sequence_parallel = True
        self.in_features = layout.full_size
        self.out_features = weight.shape[self._weight_dim(0)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, in / tp) when input_is_parallel, else (B, T, in) replicated
        if not self.input_is_parallel:
            x = scatter_to_tensor_region(x, self.group, self.layout.with_dim(-1))
        y = F.linear(x, self.linear_weight())  # (B, T, out): this rank's partial sum
        if self.sequence_parallel:  # -> (B, T / tp, out)
            y = reduce_scatter_to_sequence_region(y, self.group, self.sequence_dim)
        else:
            y = reduce_from_tensor_region(y, self.group)  # (B, T, out)
        return y if self.bias is None else y + self.bias


@torch.no_grad()
def sum_sequence_parallel_grads(module: nn.Module, group: Any) -> None:
    """All-reduce over ``group`` the gradients of replicated parameters marked
    ``sequence_parallel`` (used on token shards: norms, a sequence-parallel row bias).

    Megatron's rule; the engine does this once per step before the gradient reduction.
    """
    grads = [
        p.grad
        for p in module.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if grads and comm.get_world_size(group) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=group)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over the tensor axis."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        """Initialise like ``nn.Embedding`` on the full table, keep this rank's rows."""
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device, dtype=dtype)
        group = default_tensor_group() if group is None else group
        layout = ShardLayout.of(0, even_split(num_embeddings, comm.get_world_size(group)))
        self._init_from(full, layout, group, None)

    @classmethod
    def from_module(
        cls,
        module: nn.Embedding,
        layout: ShardLayout,
        *,
        group: Any = None,
        weight: nn.Parameter | None = None,
    ) -> VocabParallelEmbedding:
        """Shard ``module`` by ``layout``, or share ``weight`` (a tied, already sharded head)."""
        cls.check_supported(module)
        self = cls.__new__(cls)
        self._init_from(module, layout, group, weight)
        return self

    @staticmethod
    def check_supported(module: nn.Module) -> None:
        """Refuse embeddings whose options need every row on one rank."""
        if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward:
            raise NotImplementedError(
                f"VocabParallelEmbedding replaces a plain nn.Embedding, not {type(module).__name__} "
                "(a custom forward); keep this embedding replicated."
            )
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError(
                "VocabParallelEmbedding does not support max_norm, scale_grad_by_freq or sparse "
                "embeddings (no rank holds every row); keep this embedding replicated."
            )

    def _init_from(
        self, module: nn.Embedding, layout: ShardLayout, group: Any, weight: nn.Parameter | None
    ) -> None:
        assert layout.dim == 0 and layout.num_sub == 1, "the vocabulary is split on rows"
        nn.Module.__init__(self)
        self.group = default_tensor_group() if group is None else group
        self.tp_size = comm.get_world_size(self.group)
        self.tp_rank = comm.get_rank(self.group)
        self.layout = layout
        self.num_embeddings, self.embedding_dim = module.weight.shape
        ((self.vocab_start, self.vocab_end),) = layout.ranges(self.tp_rank)
        if weight is None:
            weight = _shard_param(module.weight, layout, self.tp_rank, module.weight.requires_grad)
        self.weight = weight
        pad = module.padding_idx
        self.padding_idx = (
            pad - self.vocab_start
            if pad is not None and self.vocab_start <= pad < self.vocab_end
            else None
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: (B, T) global token ids, the same on every tensor rank
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (B, T)
        local_ids = (ids - self.vocab_start).masked_fill(foreign, 0)
        out = F.embedding(local_ids, self.weight, self.padding_idx)  # (B, T, D)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        return reduce_from_tensor_region(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, "
            f"{self.vocab_end}), tp={self.tp_rank}/{self.tp_size}"
        )
