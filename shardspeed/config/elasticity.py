"""``elasticity``: compute the batch keys from the world size (DeepSpeed <= 0.19.6).

With ``"enabled": true`` the block owns the batch: ``train_batch_size``,
``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` are computed by
:func:`shardspeed.elasticity.compute_elastic_config` for the data-parallel world size when
the batch is resolved, as DeepSpeed's ``DeepSpeedConfig`` did:

* the global batch is the elastic one, the same at every valid world size;
* the micro batch is the largest of ``micro_batch_sizes`` dividing the per-rank batch;
* the accumulation steps make up the rest: ``batch // (micro * dp_world_size)``.

Batch keys given beside an enabled block are an error (DeepSpeed's rule), unless
``ignore_non_elastic_batch_info`` is true, which ignores them with a warning. A world size
that is not one of the valid GPU counts is an error when the batch is resolved.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from shardspeed.config.base import ConfigError, ConfigIssue, ConfigModel, Float, Int, join_path
from shardspeed.elasticity import constants as ec
from shardspeed.elasticity.config import ElasticityConfig, ElasticityError
from shardspeed.elasticity.elasticity import (
    algorithm_version,
    compute_elastic_config,
    ensure_immutable_elastic_config,
)
from shardspeed.utils.logging import get_logger, warning_once

logger = get_logger(__name__)


class ElasticTrainingConfig(ConfigModel):
    """``elasticity``: one global batch size for a job whose GPU count may change.

    The DeepSpeed-compatible reader of the same dict is
    :class:`shardspeed.elasticity.ElasticityConfig`; this typed block is what the runtime uses.
    """

    json_key = ec.ELASTICITY

    enabled: bool = Field(False, description="Compute the batch keys from this block.")
    max_train_batch_size: Int = Field(
        ec.MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT,
        description="Upper bound of the global batch (required when enabled).",
    )
    micro_batch_sizes: list[Int] = Field(
        default_factory=lambda: list(ec.MICRO_BATCHES_DEFAULT),
        description="Per-rank batch sizes the model fits (required when enabled).",
    )
    min_gpus: Int = Field(ec.MIN_GPUS_DEFAULT, description="Smallest GPU count to suit.")
    max_gpus: Int = Field(ec.MAX_GPUS_DEFAULT, description="Largest GPU count to suit.")
    num_gpus_per_node: Int = Field(
        ec.NUM_GPUS_PER_NODE_DEFAULT, description="GPUs per node (version 0.2 scales by node)."
    )
    model_parallel_size: Int = Field(
        ec.MODEL_PARALLEL_SIZE_DEFAULT,
        description="GPUs per model replica (version 0.2; must divide num_gpus_per_node).",
    )
    min_time: Float = Field(
        ec.MIN_TIME_DEFAULT, description="Minutes before a scheduler may rescale (unused here)."
    )
    prefer_larger_batch: bool = Field(
        ec.PREFER_LARGER_BATCH_DEFAULT,
        description="Between equally elastic batch sizes, take the larger.",
    )
    ignore_non_elastic_batch_info: bool = Field(
        ec.IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT,
        description="Ignore (with a warning) batch keys given beside the block.",
    )
    version: Float = Field(
        ec.VERSION_DEFAULT, description="Search algorithm: 0.1 (per GPU) or 0.2 (per node)."
    )

    def given(self) -> dict[str, Any]:
        """The keys the user wrote (``"auto"`` values excluded), as the JSON block."""
        return {name: getattr(self, name) for name in self.model_fields_set}

    @model_validator(mode="after")
    def _check(self) -> ElasticTrainingConfig:
        if self.enabled:
            try:
                algorithm_version(ElasticityConfig(self.given()))
            except ElasticityError as exc:
                raise ConfigError.at(exc.key or "enabled", _text(exc)) from None
        return self

    def check_batch_keys(self, given: dict[str, int]) -> None:
        """Refuse batch keys beside an enabled block, or warn that they are ignored.

        Raises:
            ConfigError: one issue per key, unless ``ignore_non_elastic_batch_info`` is true.
        """
        if not given:
            return
        shown = ", ".join(f"{key}={value}" for key, value in given.items())
        if self.ignore_non_elastic_batch_info:
            warning_once(
                f"ds_config {shown} ignored: elasticity is enabled with "
                "ignore_non_elastic_batch_info, so the batch keys are computed from the "
                "elasticity block for the data-parallel world size."
            )
            return
        message = (
            f"is set ({shown}) but elasticity is enabled and computes the batch keys from "
            "the world size. Fix: remove train_batch_size, train_micro_batch_size_per_gpu and "
            "gradient_accumulation_steps, or set "
            f'"{ec.ELASTICITY}": {{"{ec.IGNORE_NON_ELASTIC_BATCH_INFO}": true}} to ignore them'
        )
        raise ConfigError.from_issues([ConfigIssue(key, message) for key in given])

    def batch_for(self, dp_world_size: int) -> tuple[int, int, int]:
        """``(train_batch_size, micro_batch_per_gpu, grad_accum_steps)`` for a world size.

        Raises:
            ConfigError: naming the elasticity key at fault, e.g. a world size that is not
                one of the valid GPU counts, or a scheduler config that differs.
        """
        block = self.given()
        try:
            batch, valid_gpus, micro = compute_elastic_config(
                {ec.ELASTICITY: block},
                ec.COMPATIBLE_DEEPSPEED_VERSION,
                world_size=dp_world_size,
            )
            ensure_immutable_elastic_config(block)
        except ElasticityError as exc:
            path = join_path(ec.ELASTICITY, exc.key)
            raise ConfigError.from_issues([ConfigIssue(path, _text(exc))]) from exc
        assert micro is not None  # a positive world size always yields a micro batch
        if batch < micro * dp_world_size:
            raise ConfigError.from_issues(
                [
                    ConfigIssue(
                        join_path(ec.ELASTICITY, ec.MAX_ACCEPTABLE_BATCH_SIZE),
                        f"the elastic batch for {dp_world_size} data-parallel ranks is "
                        f"{batch}, below one micro batch ({micro}) per rank. Fix: raise "
                        f"max_train_batch_size to at least {micro * dp_world_size}",
                    )
                ]
            )
        gas = batch // (micro * dp_world_size)
        logger.info(
            "elasticity: train_batch_size=%d, train_micro_batch_size_per_gpu=%d, "
            "gradient_accumulation_steps=%d for %d data-parallel ranks; valid counts: %s",
            batch,
            micro,
            gas,
            dp_world_size,
            valid_gpus,
        )
        return batch, micro, gas


def _text(exc: ElasticityError) -> str:
    """The error's message without its leading ``elasticity.<key>`` (the path names it)."""
    text = str(exc)
    prefix = f"{ec.ELASTICITY}.{exc.key} "
    return text[len(prefix) :] if exc.key and text.startswith(prefix) else text
