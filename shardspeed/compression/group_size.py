"""Group-wise weight scales that match the int8 / int4 inference kernels (ZeroQuant).

DeepSpeed's ``quantize_groups`` cuts each flattened weight into that many equal groups,
one count for every layer, so layers of different shapes get groups of different sizes.
ZeroQuant's group-wise quantization and the weight-only kernels instead give each row one
scale per ``group_size`` input columns. :func:`set_weight_group_size` switches the
weight-quantized linears of a compressed model to that grouping (``numel / group_size``
groups of the flattened ``(out, in)`` weight are exactly those row pieces), so that a
cleaned model's weights lie on the grid the kernels store and load into them exactly::

    model = init_compression(model, ds_config)      # weight_quantization enabled
    set_weight_group_size(model, 128)               # one scale per row and 128 columns
"""

from __future__ import annotations

import logging

from torch import nn

from shardspeed.compression.linear import CompressedLinear

logger = logging.getLogger(__name__)


def set_weight_group_size(model: nn.Module, group_size: int | None) -> int:
    """Give every weight-quantized linear of ``model`` one scale per row and ``group_size``
    input columns (None: one scale per row).

    Returns:
        How many layers were changed.

    Raises:
        ValueError: ``group_size`` is not positive or does not divide a layer's
            ``in_features``.
    """
    if group_size is not None and (isinstance(group_size, bool) or group_size < 1):
        raise ValueError(
            f"set_weight_group_size(group_size={group_size!r}): allowed: a positive int or "
            "None (one scale per row). Fix: pass e.g. 128."
        )
    changed = 0
    for name, module in getattr(model, "module", model).named_modules():
        if not isinstance(module, CompressedLinear) or module.weight_bits is None:
            continue
        columns = module.in_features if group_size is None else group_size
        if module.in_features % columns:
            raise ValueError(
                f"set_weight_group_size(group_size={group_size}): layer '{name}' has "
                f"in_features={module.in_features}, not a multiple; allowed: a divisor of "
                "every quantized layer's in_features. Fix: pick a smaller power of two or None."
            )
        module.weight_quantize_num_groups = module.weight.numel() // columns
        changed += 1
    logger.info("weight quantization: %d linear(s) now use group size %s", changed, group_size)
    return changed
