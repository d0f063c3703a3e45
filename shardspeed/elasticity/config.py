"""The elasticity block as DeepSpeed's ``ElasticityConfig`` reads it, and its error types.

:class:`ElasticityConfig` takes the block's dict (not the whole ds_config) and checks it
the way DeepSpeed 0.19.6 did: an enabled block must name ``max_train_batch_size`` and
``micro_batch_sizes``; every count must be positive; ``min_gpus <= max_gpus``. A disabled
block falls back to the defaults for the two batch keys. The attribute names are DeepSpeed's
(``max_acceptable_batch_size``, ``micro_batches``, ``prefer_larger_batch_size``), which differ
from the JSON keys.

The typed ds_config block (``shardspeed.config.elasticity``) validates the same dict for
``shardspeed.initialize``; this class is the DeepSpeed-compatible view used by the search.
"""

from __future__ import annotations

import json
from typing import Any

from shardspeed.elasticity.constants import (
    ELASTICITY,
    ENABLED,
    ENABLED_DEFAULT,
    IGNORE_NON_ELASTIC_BATCH_INFO,
    IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT,
    MAX_ACCEPTABLE_BATCH_SIZE,
    MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT,
    MAX_GPUS,
    MAX_GPUS_DEFAULT,
    MICRO_BATCHES,
    MICRO_BATCHES_DEFAULT,
    MIN_GPUS,
    MIN_GPUS_DEFAULT,
    MIN_TIME,
    MIN_TIME_DEFAULT,
    MODEL_PARALLEL_SIZE,
    MODEL_PARALLEL_SIZE_DEFAULT,
    NUM_GPUS_PER_NODE,
    NUM_GPUS_PER_NODE_DEFAULT,
    PREFER_LARGER_BATCH,
    PREFER_LARGER_BATCH_DEFAULT,
    VERSION,
    VERSION_DEFAULT,
)


class ElasticityError(ValueError):
    """Base of the elasticity errors. ``key`` is the elasticity key at fault, when one is.

    A ``ValueError`` (DeepSpeed's derived from ``Exception``), so ``except ValueError`` and
    ``except ElasticityError`` both catch it.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ElasticityConfigError(ElasticityError):
    """The elasticity block is missing, disabled or holds a value that cannot work."""


class ElasticityUnknownVersion(ElasticityConfigError, NotImplementedError):
    """``version`` is at most the latest but not an algorithm that exists (e.g. 0.15).

    Also a ``NotImplementedError``, the type DeepSpeed 0.19.6 raised for it.
    """


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the GPU counts the elastic batch size divides evenly."""


def describe(key: str, problem: str, got: Any, allowed: str, fix: str) -> str:
    """``elasticity.<key> <problem> (got <value>). Allowed: ... Fix: ...``."""
    return f"{ELASTICITY}.{key} {problem} (got {got!r}). Allowed: {allowed}. Fix: {fix}."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(params: dict[str, Any], key: str, default: int) -> int:
    value = params.get(key, default)
    if not _is_int(value) or value < 1:
        raise ElasticityConfigError(
            describe(
                key,
                "must be a positive integer",
                value,
                "an integer >= 1",
                f"set {key} to a positive integer or remove it (default {default})",
            ),
            key,
        )
    return value


class ElasticityConfig:
    """DeepSpeed's view of the ``"elasticity"`` block (``ElasticityConfig(block_dict)``).

    Raises:
        ElasticityConfigError: naming the key, the value, what is allowed and the fix.
    """

    def __init__(self, param_dict: dict[str, Any]) -> None:
        if not isinstance(param_dict, dict):
            raise ElasticityConfigError(
                f"the {ELASTICITY} block must be a JSON object (got {param_dict!r}). "
                f'Fix: write "{ELASTICITY}": {{"enabled": true, ...}}.'
            )
        self.enabled: bool = bool(param_dict.get(ENABLED, ENABLED_DEFAULT))
        for key in (MAX_ACCEPTABLE_BATCH_SIZE, MICRO_BATCHES):
            if self.enabled and key not in param_dict:
                raise ElasticityConfigError(
                    f"{ELASTICITY}.{key} is required when elasticity is enabled. "
                    f'Fix: add "{key}" to the {ELASTICITY} block (both '
                    f"{MAX_ACCEPTABLE_BATCH_SIZE} and {MICRO_BATCHES} are required).",
                    key,
                )
        self.max_acceptable_batch_size: int = _positive_int(
            param_dict, MAX_ACCEPTABLE_BATCH_SIZE, MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT
        )
        self.micro_batches: list[int] = _micro_batches(
            param_dict.get(MICRO_BATCHES, list(MICRO_BATCHES_DEFAULT))
        )
        self.min_gpus: int = _positive_int(param_dict, MIN_GPUS, MIN_GPUS_DEFAULT)
        self.max_gpus: int = _positive_int(param_dict, MAX_GPUS, MAX_GPUS_DEFAULT)
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(
                describe(
                    MIN_GPUS,
                    "cannot be greater than max_gpus",
                    self.min_gpus,
                    f"min_gpus <= max_gpus ({self.max_gpus})",
                    "lower min_gpus or raise max_gpus",
                ),
                MIN_GPUS,
            )
        self.model_parallel_size: int = _positive_int(
            param_dict, MODEL_PARALLEL_SIZE, MODEL_PARALLEL_SIZE_DEFAULT
        )
        self.num_gpus_per_node: int = _positive_int(
            param_dict, NUM_GPUS_PER_NODE, NUM_GPUS_PER_NODE_DEFAULT
        )
        self.min_time: float = param_dict.get(MIN_TIME, MIN_TIME_DEFAULT)
        if (
            isinstance(self.min_time, bool)
            or not isinstance(self.min_time, int | float)
            or (self.min_time < 0)
        ):
            raise ElasticityConfigError(
                describe(
                    MIN_TIME,
                    "must be a number of minutes >= 0",
                    self.min_time,
                    "a number >= 0 (0: unknown)",
                    "set min_time to 0 or more",
                ),
                MIN_TIME,
            )
        self.version: float | int | str = param_dict.get(VERSION, VERSION_DEFAULT)
        version_number(self.version)  # raises for a value that is not a number
        self.prefer_larger_batch_size: bool = param_dict.get(
            PREFER_LARGER_BATCH, PREFER_LARGER_BATCH_DEFAULT
        )
        self.ignore_non_elastic_batch_info: bool = param_dict.get(
            IGNORE_NON_ELASTIC_BATCH_INFO, IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT
        )

    def repr(self) -> dict[str, Any]:
        """The attributes as a dict (DeepSpeed's name for it)."""
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4)


def _micro_batches(value: Any) -> list[int]:
    allowed = "a non-empty list of positive integers, e.g. [2, 4, 8]"
    fix = "list the per-rank batch sizes the model fits in memory"
    if not isinstance(value, list) or not value:
        raise ElasticityConfigError(
            describe(MICRO_BATCHES, "must be a list of micro batch sizes", value, allowed, fix),
            MICRO_BATCHES,
        )
    if not all(_is_int(m) and m > 0 for m in value):
        raise ElasticityConfigError(
            describe(MICRO_BATCHES, "must hold only positive integers", value, allowed, fix),
            MICRO_BATCHES,
        )
    return value


def version_number(version: Any) -> float:
    """The algorithm ``version`` as a float (``0.1``, ``"0.2"``).

    Raises:
        ElasticityConfigError: if it is not a number.
    """
    try:
        if isinstance(version, bool):
            raise TypeError
        return float(version)
    except (TypeError, ValueError):
        raise ElasticityConfigError(
            describe(
                VERSION,
                "must be a number",
                version,
                "0.1 or 0.2",
                "set version to 0.2 (per node) or 0.1 (per GPU)",
            ),
            VERSION,
        ) from None
