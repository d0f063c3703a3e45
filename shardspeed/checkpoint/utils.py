"""DeepSpeed's ``deepspeed.checkpoint.utils``: helpers for saving tensors with ``torch.save``."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of ``item`` whose tensors are detached clones on ``device`` (default CPU).

    Works on a tensor and on tensors nested in lists, tuples and dicts (the dict type is
    kept); anything else is returned as is. A view is cloned so ``torch.save`` writes only
    its own elements, not the whole storage it views (a flat buffer, here).
    """
    if torch.is_tensor(item):
        device = torch.device(device)
        if device == item.device:
            return item.detach().clone()
        return item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["clone_tensors_for_torch_save"]
