"""Splitting a layer list into contiguous pipeline parts (pure functions).

``partition_balanced`` minimises the heaviest part (the pipeline runs at the pace of its
slowest stage); ``layer_weights`` turns a ``partition_method`` into per-layer weights.
Boundaries are returned as ``parts`` of length ``num_parts + 1``: part ``i`` holds layers
``parts[i] .. parts[i + 1] - 1``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from shardspeed.parallel.pipeline.layers import layer_class_name, layer_num_parameters

PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")


def _check_parts(num_items: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts}: expected >= 1.")
    if num_items < num_parts:
        raise ValueError(
            f"cannot split {num_items} layers into {num_parts} pipeline parts (every stage, "
            "or virtual stage, needs at least one layer); use fewer stages or more layers."
        )


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries giving every part ``num_items // num_parts`` items, the first ones one more."""
    _check_parts(num_items, num_parts)
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for i in range(num_parts):
        parts.append(parts[-1] + base + (1 if i < extra else 0))
    return parts


def _fits(weights: Sequence[int], num_parts: int, limit: int) -> bool:
    """Can ``weights`` be cut into at most ``num_parts`` contiguous parts of sum <= limit?"""
    used, current = 1, 0
    for w in weights:
        if w > limit:
            return False
        if current + w > limit:
            used, current = used + 1, w
        else:
            current += w
    return used <= num_parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous non-empty parts minimising the largest part's total weight.

    The bottleneck is found by binary search; then layers are assigned greedily from the
    front (each part takes as many layers as fit, keeping one layer per remaining part).
    Weights must be non-negative ints; all-zero weights fall back to a uniform split.
    """
    n = len(weights)
    _check_parts(n, num_parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"partition weights must be >= 0, got {list(weights)}")
    if sum(weights) == 0:
        return partition_uniform(n, num_parts)
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(weights, num_parts, mid):
            hi = mid
        else:
            lo = mid + 1
    limit = lo
    parts = [0]
    start = 0
    for part in range(num_parts):
        remaining_parts = num_parts - part - 1
        end, total = start, 0
        # take at least one layer, then more while under the limit and leaving enough layers
        while end < n - remaining_parts and (end == start or total + weights[end] <= limit):
            total += weights[end]
            end += 1
        parts.append(end)
        start = end
    parts[-1] = n
    return parts


def layer_weights(method: str, layers: Sequence[Any]) -> list[int]:
    """Per-layer weights for ``partition_method`` (``parameters``, ``uniform``, ``type:<regex>``)."""
    if not isinstance(method, str):
        raise ValueError(f"partition_method={method!r}: expected a string.")
    lowered = method.lower()
    if lowered == "parameters":
        return [layer_num_parameters(layer) for layer in layers]
    if lowered == "uniform":
        return [1] * len(layers)
    if lowered.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as err:
            raise ValueError(
                f"partition_method={method!r}: {pattern!r} is not a valid regex ({err})."
            ) from err
        weights = [1 if regex.search(layer_class_name(layer)) else 0 for layer in layers]
        if not any(weights):
            names = sorted({layer_class_name(layer) for layer in layers})
            raise ValueError(
                f"partition_method={method!r} matches no layer; layer class names are {names}."
            )
        return weights
    if lowered == "profile":
        raise NotImplementedError(
            "partition_method='profile' is not implemented (DeepSpeed does not implement it "
            "either); use 'parameters', 'uniform' or 'type:<regex>'."
        )
    raise ValueError(
        f"partition_method={method!r} is not supported; allowed: {', '.join(PARTITION_METHODS)}."
    )


def partition_layers(method: str, layers: Sequence[Any], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``layers`` by ``method``."""
    if method.lower() == "uniform":
        return partition_uniform(len(layers), num_parts)
    return partition_balanced(layer_weights(method, layers), num_parts)
