"""``is_torch_elastic_compatible``: whether torch has ``torch.distributed.elastic``."""

from __future__ import annotations


def is_torch_elastic_compatible() -> bool:
    """True: torch elastic arrived in torch 1.11 and ShardSpeed requires torch 2.5 or later."""
    return True
