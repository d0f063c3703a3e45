"""The byte encoding ``save_16bit_model`` streams tensors to rank 0 with (pure parts)."""

from __future__ import annotations

import pytest
import torch

from shardspeed.checkpoint.model_export import _as_bytes, _describe


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor(2.5, dtype=torch.float16),  # 0-dim
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
        torch.empty(0, 4),
    ],
    ids=["bf16", "bool", "scalar", "strided", "empty"],
)
def test_bytes_round_trip_every_dtype_and_shape(tensor: torch.Tensor) -> None:
    kind, shape, dtype, nbytes = _describe(tensor)
    wire = _as_bytes(tensor)
    assert kind == "tensor" and wire.dtype == torch.uint8 and wire.numel() == nbytes
    back = wire.clone().view(dtype).reshape(shape)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_non_tensor_entries_travel_as_values() -> None:
    assert _describe({"version": 2}) == ("value", {"version": 2})
