"""DeepSpeed's ``deepspeed.runtime.sparse_tensor``: a row-sparse gradient.

``nn.Embedding(sparse=True)`` produces gradients as sparse COO tensors that touch only the
looked-up rows. :class:`SparseTensor` keeps such a gradient as ``indices`` (row ids, shape
``(nnz,)``) and ``values`` (those rows, ``(nnz, dim)``) so data-parallel ranks can exchange
and concatenate them instead of reducing the dense ``(num_rows, dim)`` matrix; repeated
row ids are summed when it is turned back into a tensor.
"""

from __future__ import annotations

import torch


class SparseTensor:
    """A row-sparse tensor built from a natively sparse (COO) tensor (module docstring)."""

    def __init__(self, dense_tensor: torch.Tensor | None = None) -> None:
        self.orig_dense_tensor = dense_tensor
        self.indices: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.dense_size: list[int] | None = None
        if dense_tensor is None:
            return
        if not dense_tensor.is_sparse:
            raise ValueError(
                f"SparseTensor(dense_tensor): got a dense {tuple(dense_tensor.shape)} tensor; "
                "it is built from a natively sparse gradient (nn.Embedding(sparse=True)). "
                "Fix: pass tensor.to_sparse() or the sparse gradient itself."
            )
        self.is_sparse = True
        self.dtype = dense_tensor.dtype
        coalesced = dense_tensor.coalesce()
        self.indices = coalesced.indices().flatten()  # (nnz,) row ids
        self.values = coalesced.values()  # (nnz, dim)
        self.dense_size = list(coalesced.size())

    @staticmethod
    def type() -> str:
        return "deepspeed.SparseTensor"

    def to_coo_tensor(self) -> torch.Tensor:
        """The sparse COO tensor (rows given twice are summed when coalesced)."""
        assert self.indices is not None and self.values is not None
        return torch.sparse_coo_tensor(
            self.indices.unsqueeze(0), self.values, self.dense_size, check_invariants=False
        )

    def to_dense(self) -> torch.Tensor:
        """The dense ``dense_size`` tensor."""
        return self.to_coo_tensor().to_dense()

    def sparse_size(self) -> tuple[int, int]:
        """(elements stored: indices + values, elements of the dense matrix)."""
        assert self.indices is not None and self.values is not None
        assert self.dense_size is not None
        stored = self.indices.shape[0] + self.values.shape[0] * self.values.shape[1]
        return stored, self.dense_size[0] * self.dense_size[1]

    def add(self, b: SparseTensor) -> None:
        """Append ``b``'s rows (same dense size) to this tensor's, in place."""
        if self.dense_size != b.dense_size:
            raise ValueError(
                f"SparseTensor.add: dense sizes differ ({self.dense_size} vs {b.dense_size}); "
                "only gradients of the same parameter can be added."
            )
        assert self.indices is not None and self.values is not None
        assert b.indices is not None and b.values is not None
        self.indices = torch.cat([self.indices, b.indices])
        self.values = torch.cat([self.values, b.values])

    def __str__(self) -> str:
        stored, dense = self.sparse_size()
        assert self.indices is not None and self.values is not None
        return (
            f"DeepSpeed.SparseTensor(indices_size={self.indices.size()}, "
            f"values_size={self.values.size()}, dense_size={self.dense_size}, "
            f"device={self.indices.get_device()}, reduction_factor={dense / stored})"
        )

    __repr__ = __str__


__all__ = ["SparseTensor"]
