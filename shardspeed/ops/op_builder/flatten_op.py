"""The ``utils`` op (``UtilsBuilder().load()``): flatten a list of tensors and back.

``flatten(tensors)`` concatenates the tensors' elements into one new 1-D tensor;
``unflatten(flat, tensors)`` returns views of ``flat`` shaped like ``tensors``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One contiguous 1-D tensor holding every element of ``tensors``, in order."""
    if len(tensors) == 1:
        return tensors[0].contiguous().view(-1)
    # flat: (sum of numel,)
    return torch.cat([t.contiguous().view(-1) for t in tensors])


def unflatten(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` with the shapes of ``tensors`` (the inverse of :func:`flatten`).

    Raises:
        ValueError: ``flat`` has a different number of elements than ``tensors`` together.
    """
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(
            f"unflatten: flat has {flat.numel()} elements but the tensors hold {total}; "
            "pass the same tensor list that was flattened."
        )
    outputs = []
    offset = 0
    for t in tensors:
        outputs.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return outputs
