"""DeepSpeed's elasticity API: ``compute_elastic_config`` and its two checks.

``compute_elastic_config`` turns an ``"elasticity"`` block into one global batch size and
the GPU (data-parallel) counts it suits; with a world size it also picks the micro batch.
The search itself is in :mod:`shardspeed.elasticity.search`. A resource scheduler calls this
to choose GPU counts; the runtime calls it (through ``shardspeed.config``) to set the batch
keys. Both must see the same block, which :func:`ensure_immutable_elastic_config` checks
through the ``DEEPSPEED_ELASTICITY_CONFIG`` environment variable.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from shardspeed.elasticity.config import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    ElasticityUnknownVersion,
    version_number,
)
from shardspeed.elasticity.constants import (
    COMPATIBLE_DEEPSPEED_VERSION,
    DEEPSPEED_ELASTICITY_CONFIG,
    ELASTICITY,
    ENABLED,
    ENABLED_DEFAULT,
    FORMAT,
    LATEST_ELASTICITY_VERSION,
    MINIMUM_DEEPSPEED_VERSION,
)
from shardspeed.elasticity.search import (
    HCN_LIST,
    compatible_gpus_v01,
    compatible_gpus_v02,
    get_best_candidates,
    get_candidate_batch_sizes,
    get_valid_gpus,
)
from shardspeed.utils.logging import get_logger, warning_once

logger = get_logger(__name__)

__all__ = [
    "HCN_LIST",
    "algorithm_version",
    "compute_elastic_config",
    "elasticity_enabled",
    "ensure_immutable_elastic_config",
    "get_best_candidates",
    "get_candidate_batch_sizes",
    "get_valid_gpus",
]

_SUPPORTED_VERSIONS = (0.1, 0.2)


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if match is None:
        raise ElasticityError(
            f"target_deepspeed_version {version!r} is not a version number. Fix: pass a "
            f"release such as {COMPATIBLE_DEEPSPEED_VERSION!r}."
        )
    return tuple(int(part) for part in match.group(1).split("."))


def _check_target_version(target_deepspeed_version: str) -> None:
    target = _release(target_deepspeed_version)
    minimum = _release(MINIMUM_DEEPSPEED_VERSION)
    width = max(len(target), len(minimum))
    if target + (0,) * (width - len(target)) < minimum + (0,) * (width - len(minimum)):
        raise ElasticityError(
            f"target_deepspeed_version {target_deepspeed_version} has no elasticity: it first "
            f"appeared in DeepSpeed {MINIMUM_DEEPSPEED_VERSION}. Fix: target "
            f"{MINIMUM_DEEPSPEED_VERSION} or later."
        )


def algorithm_version(config: ElasticityConfig) -> float:
    """The block's algorithm version (0.1 or 0.2), checked against its other settings.

    Raises:
        ElasticityConfigError: for another version (``ElasticityUnknownVersion``, also a
            ``NotImplementedError``, below 0.2), or model parallelism with version 0.1.
    """
    version = version_number(config.version)
    if config.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(
            f"elasticity.model_parallel_size is {config.model_parallel_size} but version "
            f"{config.version} has no model parallelism. Fix: set version to 0.2.",
            "model_parallel_size",
        )
    if version not in _SUPPORTED_VERSIONS:
        # DeepSpeed: above the latest is a config error, an unknown lower one not implemented
        newer = version > LATEST_ELASTICITY_VERSION
        raise (ElasticityConfigError if newer else ElasticityUnknownVersion)(
            f"elasticity.version {config.version} is not supported. Allowed: 0.1 or 0.2 "
            f"(latest {LATEST_ELASTICITY_VERSION}). Fix: set version to 0.2.",
            "version",
        )
    return version


def elasticity_enabled(ds_config: dict[str, Any]) -> bool:
    """True when ``ds_config`` has an ``"elasticity"`` block with ``"enabled": true``."""
    if ELASTICITY not in ds_config:
        return False
    return ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT)


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict[str, Any]) -> None:
    """Check the runtime's elasticity block against the scheduler's.

    The scheduler exports the block it planned with as JSON in ``DEEPSPEED_ELASTICITY_CONFIG``;
    ``max_train_batch_size``, ``micro_batch_sizes`` and ``version`` must be equal, or the
    scheduler's GPU counts would not suit the runtime's batch size. Without the variable
    this only warns (once per process).

    Raises:
        ElasticityConfigError: naming the first key that differs and both values.
    """
    scheduler_json = os.environ.get(DEEPSPEED_ELASTICITY_CONFIG)
    if scheduler_json is None:
        warning_once(
            f"{DEEPSPEED_ELASTICITY_CONFIG} is not set, so it cannot be checked that the "
            "resource scheduler planned GPU counts with this elasticity config.",
            name=__name__,
        )
        return
    try:
        scheduler_dict = json.loads(scheduler_json)
    except json.JSONDecodeError as exc:
        raise ElasticityConfigError(
            f"{DEEPSPEED_ELASTICITY_CONFIG} is not valid JSON ({exc}). Fix: export the "
            "elasticity block as JSON, or unset the variable."
        ) from None
    scheduler = ElasticityConfig(scheduler_dict)
    runtime = ElasticityConfig(runtime_elastic_config_dict)
    compared = (
        ("max_train_batch_size", "max_acceptable_batch_size"),
        ("micro_batch_sizes", "micro_batches"),
        ("version", "version"),
    )
    for key, attribute in compared:
        planned, running = getattr(scheduler, attribute), getattr(runtime, attribute)
        if planned != running:
            raise ElasticityConfigError(
                f"{ELASTICITY}.{key} is {running!r} in the runtime config but {planned!r} in "
                f"the config the resource scheduler saw ({DEEPSPEED_ELASTICITY_CONFIG}). Fix: "
                "start the job with the same elasticity block the scheduler was given.",
                key,
            )


def _env_world_size(version: Any, purpose: str) -> int:
    text = os.environ.get("WORLD_SIZE")
    if text is None or not text.isnumeric() or int(text) < 1:
        raise ElasticityConfigError(
            f"elasticity version {version} needs the world size to {purpose}, but "
            f"world_size is 0 and WORLD_SIZE is {text!r}. Fix: pass world_size= to "
            "compute_elastic_config or export WORLD_SIZE."
        )
    return int(text)


def _micro_batch_for(
    final_batch_size: int, world_size: int, valid_gpus: list[int], micro_batches: list[int]
) -> int:
    """The largest micro batch dividing the per-rank batch, once ``world_size`` is valid."""
    if world_size not in valid_gpus:
        raise ElasticityIncompatibleWorldSize(
            f"world size {world_size} does not suit the elastic batch size "
            f"{final_batch_size}: the valid GPU counts are {valid_gpus}. Fix: run on one of "
            "those counts, or widen elasticity.micro_batch_sizes / min_gpus / max_gpus."
        )
    per_rank = final_batch_size // world_size
    for micro in sorted(set(micro_batches), reverse=True):
        if per_rank % micro == 0:
            return micro
    raise ElasticityError(
        f"no micro batch in {micro_batches} divides the per-rank batch {per_rank} "
        f"(batch {final_batch_size} on {world_size} ranks)."
    )


def compute_elastic_config(
    ds_config: dict[str, Any],
    target_deepspeed_version: str,
    world_size: int = 0,
    return_microbatch: bool = False,
) -> tuple[int, list[int]] | tuple[int, list[int], int | None]:
    """The elastic batch size for ``ds_config["elasticity"]`` and the GPU counts it suits.

    Deterministic: the scheduler and every rank get the same answer for the same block.

    Args:
        ds_config: the whole ds_config dict (with an enabled ``"elasticity"`` block).
        target_deepspeed_version: the DeepSpeed release the job runs (at least 0.3.8).
        world_size: the data-parallel world size, if known. When positive it must be one of
            the valid counts, and the micro batch is returned too.
        return_microbatch: with ``world_size`` 0, also return a micro batch (the world size
            is then read from ``WORLD_SIZE``).

    Returns:
        ``(final_batch_size, valid_gpus)``, or ``(final_batch_size, valid_gpus,
        micro_batch_size)`` when ``world_size > 0`` or ``return_microbatch``. For version 0.2
        the counts are data-parallel sizes (GPUs / model_parallel_size).

    Raises:
        ElasticityConfigError: the block is missing, disabled or invalid, or version 0.2 has
            no world size.
        ElasticityIncompatibleWorldSize: ``world_size`` is not a valid count.
        ElasticityError: ``target_deepspeed_version`` predates elasticity, or
            ``num_gpus_per_node`` is not a multiple of ``model_parallel_size``.
    """
    if not isinstance(ds_config, dict):
        raise ValueError(
            f"ds_config must be a dict, got {type(ds_config).__name__}: {ds_config!r}. Fix: "
            "pass the parsed config dict."
        )
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(
            f"the ds_config has no '{ELASTICITY}' block. Fix: add one for an elastic job." + FORMAT
        )
    block = ds_config[ELASTICITY]
    if not isinstance(block, dict) or not block.get(ENABLED, ENABLED_DEFAULT):
        raise ElasticityConfigError(
            f"elasticity is disabled (got {block!r}). Fix: set "
            f'"{ELASTICITY}": {{"enabled": true, ...}} for an elastic job.'
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0:
        raise ValueError(
            f"world_size must be an integer >= 0 (got {world_size!r}). Fix: pass the "
            "data-parallel world size, or 0 when it is not known."
        )
    config = ElasticityConfig(block)
    version = algorithm_version(config)
    _check_target_version(target_deepspeed_version)

    micro_for_v02: int | None = None
    if version == 0.1:
        final_batch_size, valid_gpus = compatible_gpus_v01(
            config.micro_batches,
            config.max_acceptable_batch_size,
            min_gpus=config.min_gpus,
            max_gpus=config.max_gpus,
            prefer_larger=config.prefer_larger_batch_size,
        )
    else:
        current = world_size or _env_world_size(config.version, "compute the batch size")
        final_batch_size, valid_gpus, micro_for_v02 = compatible_gpus_v02(
            config.micro_batches,
            config.max_acceptable_batch_size,
            current,
            min_gpus=config.min_gpus,
            max_gpus=config.max_gpus,
            prefer_larger=config.prefer_larger_batch_size,
            num_gpus_per_node=config.num_gpus_per_node,
            model_parallel_size=config.model_parallel_size,
        )
    final_batch_size = int(final_batch_size)
    logger.info("Elastic batch size %d; valid GPU counts: %s", final_batch_size, valid_gpus)

    if world_size > 0:
        micro = _micro_batch_for(final_batch_size, world_size, valid_gpus, config.micro_batches)
        return final_batch_size, valid_gpus, micro
    if return_microbatch:
        if version == 0.2:
            return final_batch_size, valid_gpus, micro_for_v02
        env_world = _env_world_size(config.version, "compute a micro batch size")
        micro = _micro_batch_for(final_batch_size, env_world, valid_gpus, config.micro_batches)
        return final_batch_size, valid_gpus, micro
    return final_batch_size, valid_gpus
