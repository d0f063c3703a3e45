"""How one sample is split over a sequence group: contiguous token chunks, in rank order.

Every rank of a sequence group gets the *same* samples (the data loader shards over the
data axis only) and keeps tokens ``[r*s/p, (r+1)*s/p)`` of each. Positions stay global:
rank ``r``'s position ids start at ``r*s/p``, so rotary embeddings match the full sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm


def _check_divisible(length: int, num_ranks: int, what: str) -> None:
    if length % num_ranks:
        raise ValueError(
            f"sequence parallelism splits {what} of length {length} over {num_ranks} ranks, "
            f"which needs a multiple of {num_ranks}; pad the sequence to "
            f"{-(-length // num_ranks) * num_ranks} tokens."
        )


def shard_sequence(tensor: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous chunk of ``tensor`` along ``dim`` (e.g. ``input_ids`` (b, s))."""
    num_ranks, rank = comm.get_world_size(group), comm.get_rank(group)
    _check_divisible(tensor.shape[dim], num_ranks, f"dim {dim} of a tensor {tuple(tensor.shape)}")
    return tensor.chunk(num_ranks, dim=dim)[rank].contiguous()


def local_position_ids(
    num_local_tokens: int, group: Any, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions of this rank's tokens, shape (1, s/p)."""
    start = comm.get_rank(group) * num_local_tokens
    return torch.arange(start, start + num_local_tokens, device=device).unsqueeze(0)
