"""``zero_optimization``: the ZeRO sharding policy and its CPU/NVMe offload sub-blocks.

Field names follow the ds_config keys. The ZeRO-3 knobs are named ``stage3_*`` as in the
DeepSpeed docs; the short names DeepSpeed's code uses (``prefetch_bucket_size``, ...) are
accepted as input keys and readable as properties. Legacy keys map as DeepSpeed maps them:
``cpu_offload`` -> ``offload_optimizer: {device: cpu}``, ``cpu_offload_param`` ->
``offload_param: {device: cpu}``, ``cpu_offload_use_pin_memory`` -> their ``pin_memory``,
``stage3_gather_fp16_weights_on_model_save`` -> ``stage3_gather_16bit_weights_on_model_save``.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from shardspeed.config.base import ConfigError, ConfigModel, Float, Int, explain, lower_str
from shardspeed.utils.logging import warning_once

# Default zero_optimization.overlap_bucket_size, in elements (see the field).
OVERLAP_BUCKET_SIZE = 6_553_600  # 25 MiB of fp32 gradients, DDP's bucket_cap_mb

OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(lower_str)]


def _check_nvme_path(device: str, nvme_path: str | None) -> None:
    if device == "nvme" and not nvme_path:
        raise ConfigError.at(
            "nvme_path",
            explain(
                'is required when device is "nvme"',
                nvme_path,
                fix='add "nvme_path": "/local_nvme" (a directory on a fast local NVMe drive)',
            ),
        )


def _none_means_true(value: Any) -> Any:
    """``overlap_comm: null`` means the default (true); "auto" is dropped by the base class."""
    return True if value is None else value


class OffloadParamConfig(ConfigModel):
    """``zero_optimization.offload_param``: keep ZeRO-3 parameter shards on CPU or NVMe."""

    json_key = "zero_optimization.offload_param"

    device: OffloadDevice = Field("none", description='"none", "cpu" or "nvme".')
    nvme_path: str | None = Field(None, description="Directory for NVMe swap files.")
    pin_memory: bool = Field(True, description="Use page-locked CPU buffers (faster copies).")
    buffer_count: Int = Field(5, ge=1, description="Number of NVMe swap buffers.")
    buffer_size: Int = Field(int(1e8), ge=1, description="Elements per NVMe swap buffer.")
    max_in_cpu: Int = Field(
        int(1e9), ge=0, description="Elements kept in CPU memory when swapping to NVMe."
    )

    @model_validator(mode="after")
    def _check(self) -> OffloadParamConfig:
        _check_nvme_path(self.device, self.nvme_path)
        return self


class OffloadOptimizerConfig(ConfigModel):
    """``zero_optimization.offload_optimizer``: optimizer state + step on CPU (or NVMe)."""

    json_key = "zero_optimization.offload_optimizer"

    device: OffloadDevice = Field("none", description='"none", "cpu" or "nvme" (stage 3).')
    nvme_path: str | None = Field(None, description="Directory for NVMe swap files.")
    pin_memory: bool = Field(True, description="Use page-locked CPU buffers (faster copies).")
    buffer_count: Int = Field(4, ge=1, description="Number of NVMe swap buffers.")
    pipeline_read: bool = Field(False, description="Overlap NVMe reads with the optimizer step.")
    pipeline_write: bool = Field(False, description="Overlap NVMe writes with the optimizer step.")
    fast_init: bool = Field(False, description="Faster optimizer initialisation with NVMe.")
    ratio: Float = Field(
        1.0,
        gt=0,
        le=1,
        description="Fraction of the optimizer step run on CPU; < 1 only at stage 3.",
    )
    super_offload: bool = Field(False, description="SuperOffload (CPU step overlap) mode.")
    cpuadam_cores_perc: Float = Field(
        0.8, gt=0, le=1, description="Fraction of CPU cores the CPU optimizer may use."
    )

    @property
    def pipeline(self) -> bool:
        """True when NVMe reads or writes are pipelined with the step."""
        return self.pipeline_read or self.pipeline_write

    @model_validator(mode="after")
    def _check(self) -> OffloadOptimizerConfig:
        _check_nvme_path(self.device, self.nvme_path)
        return self


def _map_legacy_offload(data: dict[str, Any]) -> dict[str, Any]:
    """``cpu_offload`` / ``cpu_offload_param`` / ``cpu_offload_use_pin_memory`` -> new blocks."""
    pin = data.pop("cpu_offload_use_pin_memory", None)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in data:
            continue
        value = data.pop(old)
        if not isinstance(value, bool):
            raise ConfigError.at(old, explain("must be true or false", value))
        warning_once(
            f"ds_config key 'zero_optimization.{old}' is deprecated; use "
            f'\'zero_optimization.{new}\': {{"device": "cpu"}} instead.'
        )
        if not value:
            continue
        if data.get(new) is not None:
            raise ConfigError.at(
                old,
                explain(
                    f"conflicts with '{new}' (both given)",
                    value,
                    fix=f"remove '{old}' and keep '{new}'",
                ),
            )
        data[new] = {"device": "cpu"} if pin is None else {"device": "cpu", "pin_memory": pin}
    if pin is not None:
        warning_once(
            "ds_config key 'zero_optimization.cpu_offload_use_pin_memory' is deprecated; use "
            "'pin_memory' inside 'offload_optimizer' / 'offload_param'."
        )
    return data


class ZeroConfig(ConfigModel):
    """``zero_optimization``: which ZeRO stage shards what, bucket sizes and offload."""

    json_key = "zero_optimization"
    key_aliases = {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
        "allgather_sequential": "stage3_allgather_sequential",
        "partition_stream_chunk_size": "stage3_partition_stream_chunk_size",
    }
    deprecated_keys = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }

    stage: Int = Field(
        0, description="0 off; 1 shards optimizer state; 2 also gradients; 3 also parameters."
    )
    contiguous_gradients: bool = Field(
        True, description="Copy gradients into a contiguous buffer as they are produced."
    )
    reduce_scatter: bool = Field(
        True, description="Reduce gradients with reduce-scatter instead of all-reduce."
    )
    reduce_bucket_size: Int = Field(
        int(5e8), ge=0, description="Elements reduced per gradient bucket."
    )
    use_multi_rank_bucket_allreduce: bool = Field(
        True, description="Combine the reduce buckets of several ranks into one all-reduce."
    )
    allgather_partitions: bool = Field(
        True, description="All-gather updated parameters (instead of a series of broadcasts)."
    )
    allgather_bucket_size: Int = Field(
        int(5e8), ge=0, description="Elements all-gathered per bucket after the step."
    )
    overlap_comm: Annotated[bool, BeforeValidator(_none_means_true)] = Field(
        True,
        description="Launch each gradient bucket's reduction during backward, as soon as it "
        "is ready. True at every stage by default (DeepSpeed: only at stage 3) because it only "
        'changes when collectives start, never the result; "auto" or null mean true.',
    )
    overlap_bucket_size: Int = Field(
        OVERLAP_BUCKET_SIZE,
        ge=0,
        description="ShardSpeed option (not a DeepSpeed key). Elements per gradient "
        "collective launched during backward when overlap_comm is on: each reduce bucket is "
        "all-reduced in contiguous parts of about this size as their gradients become ready "
        "(DDP's bucket_cap_mb; the first part is 1/25 of it, as DDP's 1 MB first bucket). "
        "Applies at stage 0, and at stages 1/2 where the backend reduces with an all-reduce "
        "(gloo) and the optimizer is not offloaded. reduce_bucket_size still sets the buckets "
        "the masters, optimizer state and reduce-scatters are laid out in, so checkpoints do "
        "not depend on this value. 0 reduces whole reduce buckets.",
    )
    load_from_fp32_weights: bool = Field(
        True, description="Initialise fp32 master weights from the checkpoint's fp32 copy."
    )
    elastic_checkpoint: bool = Field(False, description="Legacy elastic checkpoint (ignored).")
    offload_param: OffloadParamConfig | None = Field(
        None, description="Offload ZeRO-3 parameter shards to CPU or NVMe (stage 3 only)."
    )
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None, description="Offload optimizer state and step to CPU/NVMe (stages 1-3)."
    )
    sub_group_size: Int = Field(
        int(1e9), ge=1, description="Parameter elements per optimizer-step sub-group (stage 3)."
    )
    stage3_prefetch_bucket_size: Int = Field(
        int(5e7), ge=0, description="Parameter elements fetched ahead of use (stage 3)."
    )
    stage3_param_persistence_threshold: Int = Field(
        int(1e5), ge=0, description="Parameters smaller than this stay unsharded (stage 3)."
    )
    stage3_model_persistence_threshold: Int = Field(
        sys.maxsize, ge=0, description="Cap on total elements kept unsharded (stage 3)."
    )
    stage3_max_live_parameters: Int = Field(
        int(1e9), ge=0, description="Gathered parameter elements kept alive per rank (stage 3)."
    )
    stage3_max_reuse_distance: Int = Field(
        int(1e9),
        ge=0,
        description="Keep a gathered parameter if it is reused within this distance (stage 3).",
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="Gather full 16-bit weights for save_16bit_model() at stage 3."
    )
    stage3_module_granularity_threshold: Int = Field(
        0, ge=0, description="Fetch fine-grained modules (params/descendants below) as one unit."
    )
    stage3_use_all_reduce_for_fetch_params: bool = Field(
        False, description="Fetch stage-3 parameters with all-reduce instead of all-gather."
    )
    stage3_allgather_sequential: bool = Field(
        False, description="All-gather stage-3 parameters one by one (no bucket copies)."
    )
    stage3_partition_stream_chunk_size: Int = Field(
        0, ge=0, description="Stream partitioning of huge parameters in chunks (0 = off)."
    )
    ignore_unused_parameters: bool = Field(
        True, description="Tolerate parameters that get no gradient (stage 2)."
    )
    legacy_stage1: bool = Field(False, description="Legacy stage-1 implementation (ignored).")
    round_robin_gradients: bool = Field(
        False, description="Round-robin gradient copies to CPU (stages 1/2 with offload)."
    )
    parameter_alignment: bool = Field(False, description="Align parameter shards (legacy).")
    zero_hpz_partition_size: Int = Field(
        1,
        ge=1,
        description="ZeRO++ hpZ: ranks per secondary weight partition (ranks per node); "
        "backward all-gathers stay within it (stage 3; 1 = off).",
    )
    zero_quantized_weights: bool = Field(
        False,
        description="ZeRO++ qwZ: all-gather weights as int8 blocks with per-block scales "
        "(stage 3).",
    )
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="Store frozen (non-trainable) weights quantized."
    )
    zero_quantized_gradients: bool = Field(
        False,
        description="ZeRO++ qgZ: reduce-scatter gradients as int4 all-to-alls, within the "
        "node then across nodes (stage 3).",
    )
    zeropp_loco_param: dict[str, Any] | None = Field(
        None, description='LoCo-ZeRO++ options, e.g. {"err_beta": 0.8, "reset_T": 1024}.'
    )
    mics_shard_size: Int = Field(-1, description="MiCS shard group size (-1 = off; legacy).")
    mics_hierarchical_params_gather: bool = Field(
        False, description="MiCS hierarchical all-gather (legacy)."
    )
    memory_efficient_linear: bool = Field(
        True, description="Memory-efficient linear autograd function (stage 3)."
    )
    pipeline_loading_checkpoint: bool = Field(
        False, description="Load checkpoints in pipeline mode (stage 3)."
    )
    override_module_apply: bool = Field(
        True, description="Gather parameters around nn.Module.apply (stage 3)."
    )
    log_trace_cache_warnings: bool = Field(
        False, description="Log stage-3 trace-cache invalidations."
    )
    enable_sanity_checks: bool = Field(False, description="Extra internal consistency checks.")
    grad_hooks: bool = Field(True, description="Use gradient hooks for reduction (stage 1).")
    compute_grad_norm: bool = Field(
        True, description="Compute the global gradient norm (false allowed at stages 1/2 only)."
    )
    save_muon_momentum_buffer_in_memory: bool = Field(
        False, description="Keep the Muon momentum buffer in memory under NVMe offload."
    )
    zenflow: dict[str, Any] | None = Field(
        None, description="ZenFlow options (accepted, not implemented)."
    )
    leaf_module: dict[str, Any] | None = Field(
        None, description="Modules treated as ZeRO-3 leaf modules (fetched as a whole)."
    )

    # -- derived views -----------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """True for stages 1-3."""
        return self.stage > 0

    @property
    def offload_optimizer_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"`` (``"none"`` when the block is absent)."""
        return self.offload_optimizer.device if self.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> str:
        """``"none"``, ``"cpu"`` or ``"nvme"`` (``"none"`` when the block is absent)."""
        return self.offload_param.device if self.offload_param else "none"

    @property
    def prefetch_bucket_size(self) -> int:
        """DeepSpeed's short name for ``stage3_prefetch_bucket_size``."""
        return self.stage3_prefetch_bucket_size

    @property
    def param_persistence_threshold(self) -> int:
        """DeepSpeed's short name for ``stage3_param_persistence_threshold``."""
        return self.stage3_param_persistence_threshold

    @property
    def model_persistence_threshold(self) -> int:
        """DeepSpeed's short name for ``stage3_model_persistence_threshold``."""
        return self.stage3_model_persistence_threshold

    @property
    def max_live_parameters(self) -> int:
        """DeepSpeed's short name for ``stage3_max_live_parameters``."""
        return self.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        """DeepSpeed's short name for ``stage3_max_reuse_distance``."""
        return self.stage3_max_reuse_distance

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's short name for ``stage3_gather_16bit_weights_on_model_save``."""
        return self.stage3_gather_16bit_weights_on_model_save

    # -- validation --------------------------------------------------------------------------

    @classmethod
    def _preprocess(cls, data: dict[str, Any]) -> dict[str, Any]:
        return _map_legacy_offload(data)

    @field_validator("stage")
    @classmethod
    def _check_stage(cls, value: int) -> int:
        if value not in (0, 1, 2, 3):
            raise ValueError(
                explain(
                    "ZeRO stage must be 0, 1, 2 or 3",
                    value,
                    fix="use 3 to shard parameters, gradients and optimizer state",
                )
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> ZeroConfig:
        stage = self.stage
        if self.offload_param_device != "none" and stage != 3:
            raise ConfigError.at(
                "offload_param",
                explain(
                    f"parameter offload needs ZeRO stage 3 (stage is {stage})",
                    {"device": self.offload_param_device},
                    fix='set "stage": 3, or remove offload_param (offload_optimizer works '
                    "at stages 1-3)",
                ),
            )
        device = self.offload_optimizer_device
        if device != "none" and stage == 0:
            raise ConfigError.at(
                "offload_optimizer",
                explain(
                    "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)",
                    {"device": device},
                    fix='set "stage" to 1, 2 or 3, or remove offload_optimizer',
                ),
            )
        if device == "nvme" and stage != 3:
            raise ConfigError.at(
                "offload_optimizer.device",
                explain(
                    f"NVMe optimizer offload needs ZeRO stage 3 (stage is {stage})",
                    device,
                    allowed='"cpu" at stages 1-2',
                    fix='set "stage": 3 or use "device": "cpu"',
                ),
            )
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1 and stage != 3:
            raise ConfigError.at(
                "offload_optimizer.ratio",
                explain(
                    f"partial offload (ratio < 1) needs ZeRO stage 3 (stage is {stage})",
                    self.offload_optimizer.ratio,
                    fix='set "ratio": 1.0 or "stage": 3',
                ),
            )
        zeropp = {
            "zero_quantized_weights": self.zero_quantized_weights,
            "zero_hpz_partition_size": self.zero_hpz_partition_size > 1,
            "zero_quantized_gradients": self.zero_quantized_gradients,
        }
        on = {k: getattr(self, k) for k, v in zeropp.items() if v}
        if on and stage != 3:
            key = next(iter(on))
            raise ConfigError.at(
                key,
                explain(
                    f"ZeRO++ ({', '.join(on)}) works on ZeRO stage 3's parameter gathers and "
                    f"gradient reduce-scatter (stage is {stage})",
                    on[key],
                    fix=f'set "stage": 3, or remove {", ".join(on)}',
                ),
            )
        if not self.compute_grad_norm and stage not in (1, 2):
            raise ConfigError.at(
                "compute_grad_norm",
                explain(
                    f"can be false only at ZeRO stages 1 and 2 (stage is {stage})",
                    False,
                    fix="remove the key",
                ),
            )
        return self
