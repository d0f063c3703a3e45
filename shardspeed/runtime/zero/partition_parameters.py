"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` (used by transformers'
ZeRO-3 ``from_pretrained``): re-exports :mod:`shardspeed.zero`'s construction-time
partitioning, where the implementation lives.

Also DeepSpeed's tensor-constructor hooks that transformers reaches for
(``prevent_arange_dtype_change`` swaps ``zero_wrapper_for_fp_tensor_constructor`` and
compares against ``_orig_torch_arange``): the original ``torch`` constructors as they were
at import, and the wrapper with DeepSpeed's semantics (default device, floating-point
results cast to the target dtype). ShardSpeed's ``Init`` does not wrap torch's
constructors: a parameter is cast to the Init dtype when it is partitioned and buffers
keep the dtype they were built with, so swapping the wrapper changes nothing inside
``Init`` (transformers swaps it precisely to keep ``arange`` buffers un-cast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardspeed.accelerator import get_accelerator
from shardspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor],
    target_fp_dtype: torch.dtype | None,
    target_device: torch.device | None,
) -> Callable[..., torch.Tensor]:
    """Wrap a tensor constructor ``fn``: ``device`` defaults to ``target_device`` (when not
    None) and a floating-point result is cast to ``target_fp_dtype`` (when not None)."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped
