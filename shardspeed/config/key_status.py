"""What ShardSpeed does with every ds_config key: USED, REFUSED or IGNORED_KNOB.

Every key the config models accept has exactly one entry in :data:`KEY_STATUS` (a unit test
walks the models and pins the set), so a key can never be accepted and silently dropped:

* ``USED``: the runtime acts on it.
* ``REFUSED``: it would change the numbers (or the meaning) of training and ShardSpeed does
  not implement it. Its default is accepted; any other value is a :class:`ConfigError` that
  names the key, the value, what is allowed and the fix.
* ``IGNORED_KNOB``: it cannot change results here (a performance/tuning knob, or an option of
  a feature that is off). When the user sets it, one warning per key per process names it
  and says why it has no effect.

:func:`check_key_status` applies the registry to a validated :class:`ShardSpeedConfig`; the
config model calls it, so ``load_config`` and direct construction are both covered.
Top-level keys that are accepted but not modelled (``autotuning``, ``amp``, ...) are handled
by :mod:`shardspeed.config.legacy`; their entries here mirror it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from shardspeed.config.base import (
    ConfigError,
    ConfigIssue,
    ConfigModel,
    explain,
    join_path,
    model_in,
)
from shardspeed.config.compile import DEEPCOMPILE_KNOBS
from shardspeed.config.legacy import UNMODELLED_KEYS
from shardspeed.config.precision import dtype_from_name
from shardspeed.utils.logging import warning_once


class KeyStatus(str, Enum):
    """How ShardSpeed treats one ds_config key."""

    USED = "used"
    REFUSED = "refused"
    IGNORED_KNOB = "ignored_knob"


@dataclass(frozen=True)
class KeyRule:
    """The status of one key and why. ``allowed``/``fix``/``accepts`` apply to REFUSED keys:
    ``accepts(value, config)`` is True for an accepted value (None: only the field default)."""

    status: KeyStatus
    reason: str
    allowed: str = ""
    fix: str = ""
    accepts: Callable[[Any, Any], bool] | None = None


def _used(where: str, *paths: str) -> dict[str, KeyRule]:
    return {path: KeyRule(KeyStatus.USED, f"read by {where}") for path in paths}


def _ignored(reason: str, *paths: str) -> dict[str, KeyRule]:
    return {path: KeyRule(KeyStatus.IGNORED_KNOB, reason) for path in paths}


def _refused(
    path: str,
    reason: str,
    allowed: str,
    fix: str,
    accepts: Callable[[Any, Any], bool] | None = None,
) -> dict[str, KeyRule]:
    return {path: KeyRule(KeyStatus.REFUSED, reason, allowed, fix, accepts)}


def _at_most_one(value: Any, _config: Any) -> bool:
    return value is None or value <= 1


def _matches_train_dtype(value: Any, config: Any) -> bool:
    return value is None or dtype_from_name(value) == config.train_dtype()


_TP = "tp.tp_size is the inference engine's tensor-parallel degree; training reads autotp_size"
_TP_OFF = (
    "an AutoTP tuning or placement knob: ShardSpeed's AutoTP trains in the engine's "
    "precision (fp16/bf16 blocks) with synchronous tensor-axis collectives"
)
_COMET_OFF = "only applies to the Comet monitor (comet.enabled), which is refused"
_AUTOCAST_OFF = "only applies to torch_autocast.enabled, which is refused"
_NVME_TUNING = "an NVMe/offload tuning knob; ShardSpeed's swapper does not use it"
_STAGE3_TUNING = (
    "a ZeRO-3 fetch tuning knob; ShardSpeed fetches one flat unit per module with "
    "stage3_prefetch_bucket_size / stage3_max_live_parameters"
)
_COLLECTIVE_TUNING = (
    "a collective tuning knob; ShardSpeed reduces gradients in reduce_bucket_size buckets "
    "(reduce-scatter or all-reduce chosen per backend) and all-gathers each parameter group "
    "in one collective"
)
_PIPE_MODULE = (
    "the pipeline layout is read from PipelineModule(...) arguments; set it there (DeepSpeed "
    "also takes it from the module)"
)
_LOGGING_ONLY = "a logging/debug option ShardSpeed does not implement; it cannot change training"


KEY_STATUS: dict[str, KeyRule] = {
    # -- batch, logging, gradients -------------------------------------------------------------
    **_used(
        "the engine",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "steps_per_print",
        "wall_clock_breakdown",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        "dataloader_drop_last",
    ),
    **_used("the config (warns when not a multiple of 8, as DeepSpeed)", "vocabulary_size"),
    **_refused(
        "managed_gradient_accumulation",
        "turning off engine-managed accumulation is not implemented; the engine always steps "
        "at the gradient_accumulation_steps boundary",
        "true",
        "remove the key; call engine.set_gradient_accumulation_boundary() to step early",
    ),
    **_ignored(_LOGGING_ONLY, "memory_breakdown", "dump_state"),
    **_ignored(
        "ShardSpeed's log level comes from the SHARDSPEED_LOG_LEVEL environment variable",
        "log_level",
    ),
    **_refused(
        "gradient_allreduce_op",
        "summed (not averaged) gradient reduction is not implemented; gradients are averaged "
        "over the data-parallel ranks",
        '"mean"',
        'remove the key, or scale the loss by the data-parallel world size to get "sum"',
    ),
    **_ignored(
        "Ulysses all-to-alls move activations in their own dtype (an all-to-all only "
        "permutes values, so a wider dtype cannot change them)",
        "seq_parallel_communication_data_type",
    ),
    **_ignored(
        "sparse and dense reduction give the same sums; ShardSpeed reduces embeddings densely",
        "sparse_gradients",
    ),
    **_ignored("a legacy DeepSpeed flag that DeepSpeed no longer reads", "disable_allgather"),
    **_ignored(
        "ShardSpeed accepts any elementwise optimizer at every ZeRO stage and rejects "
        "per-parameter-norm optimizers (LAMB) regardless of this flag",
        "zero_allow_untested_optimizer",
    ),
    **_ignored(
        "with CPU offload ShardSpeed always steps with its own CPU Adam where it can",
        "zero_force_ds_cpu_optimizer",
    ),
    # -- optimizer and scheduler ---------------------------------------------------------------
    **_used(
        "the optimizer/scheduler factories",
        "optimizer.type",
        "optimizer.params",
        "scheduler.type",
        "scheduler.params",
    ),
    **_ignored(
        "a legacy fused-optimizer flag; DeepSpeed no longer reads it", "optimizer.legacy_fusion"
    ),
    # -- precision -----------------------------------------------------------------------------
    **_used(
        "the precision policy / loss scaler",
        "fp16.enabled",
        "fp16.loss_scale",
        "fp16.initial_scale_power",
        "fp16.loss_scale_window",
        "fp16.hysteresis",
        "fp16.consecutive_hysteresis",
        "fp16.min_loss_scale",
        "bf16.enabled",
        "bf16.check_grad_overflow",
        "data_types.grad_accum_dtype",
    ),
    **_refused(
        "fp16.auto_cast",
        "casting forward inputs to fp16 is not implemented",
        "false",
        "remove the key and cast the inputs in your training loop",
    ),
    **_refused(
        "fp16.fp16_master_weights_and_grads",
        "fp16 master weights and gradients are not implemented; masters are fp32",
        "false",
        "remove the key",
    ),
    **_ignored(
        "ShardSpeed accumulates gradients in fp32 whenever gradient_accumulation_steps > 1 "
        "(choose another dtype with data_types.grad_accum_dtype)",
        "bf16.immediate_grad_update",
    ),
    **_refused(
        "bf16.bf16_master_weights_and_grads",
        "bf16 master weights and gradients are not implemented; masters are fp32",
        "false",
        "remove the key",
    ),
    **_refused(
        "bf16.bf16_optimizer_states",
        "bf16 optimizer states are not implemented; optimizer states are fp32",
        "false",
        "remove the key",
    ),
    **_refused(
        "data_types.param_dtype",
        "a parameter dtype other than the training dtype (fp16/bf16 blocks) is not implemented",
        "null or the dtype implied by fp16/bf16",
        'remove the key and choose the dtype with "bf16": {"enabled": true} or "fp16"',
        _matches_train_dtype,
    ),
    **_refused(
        "data_types.buffer_dtype",
        "casting module buffers is not implemented; buffers keep the dtype they were loaded in",
        "null",
        "remove the key and cast the buffers before shardspeed.initialize",
    ),
    **_refused(
        "data_types.keep_in_fp32_modules",
        "keeping selected modules in fp32 is not implemented; the whole model uses one dtype",
        "null or []",
        "remove the key",
        lambda value, _config: not value,
    ),
    **_refused(
        "torch_autocast.enabled",
        "torch.autocast training is not implemented",
        "false",
        'remove the block and use "bf16": {"enabled": true} (or "fp16")',
    ),
    **_ignored(
        _AUTOCAST_OFF, "torch_autocast.dtype", "torch_autocast.lower_precision_safe_modules"
    ),
    # -- zero_optimization ---------------------------------------------------------------------
    **_used(
        "the engine / ZeRO policies",
        "zero_optimization.stage",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.overlap_comm",
        "zero_optimization.overlap_bucket_size",
        "zero_optimization.offload_param.device",
        "zero_optimization.offload_param.nvme_path",
        "zero_optimization.offload_param.pin_memory",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    **_ignored(
        _COLLECTIVE_TUNING,
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter",
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.grad_hooks",
    ),
    **_ignored(
        _STAGE3_TUNING,
        "zero_optimization.stage3_module_granularity_threshold",
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        "zero_optimization.stage3_allgather_sequential",
        "zero_optimization.stage3_partition_stream_chunk_size",
        "zero_optimization.memory_efficient_linear",
        "zero_optimization.override_module_apply",
        "zero_optimization.leaf_module",
    ),
    **_ignored(
        _NVME_TUNING,
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_optimizer.pipeline_read",
        "zero_optimization.offload_optimizer.pipeline_write",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.offload_optimizer.ratio",
        "zero_optimization.offload_optimizer.super_offload",
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
        "zero_optimization.save_muon_momentum_buffer_in_memory",
    ),
    **_ignored(
        "an optimizer-step granularity knob; ShardSpeed steps each flat parameter group whole "
        "(elementwise optimizers give the same update either way)",
        "zero_optimization.sub_group_size",
    ),
    **_used(
        "the stage-3 sharding (ZeRO++, shardspeed.zero.zeropp; stage 3 only, refused by "
        "the zero config at other stages)",
        "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_quantized_gradients",
    ),
    **_ignored(
        "MiCS sub-group sharding only changes where states live, not the values; ShardSpeed "
        "shards over the whole data-parallel group",
        "zero_optimization.mics_shard_size",
        "zero_optimization.mics_hierarchical_params_gather",
    ),
    **_refused(
        "zero_optimization.zeropp_loco_param",
        "LoCo-ZeRO++ (error feedback for qgZ's quantized gradients) is not implemented",
        "null",
        "remove the key (zero_quantized_gradients works without it)",
    ),
    **_ignored(
        "a legacy flag DeepSpeed no longer reads",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.legacy_stage1",
        "zero_optimization.parameter_alignment",
    ),
    **_ignored(
        "ShardSpeed always tolerates parameters that get no gradient (they reduce as zeros)",
        "zero_optimization.ignore_unused_parameters",
    ),
    **_ignored(
        _LOGGING_ONLY,
        "zero_optimization.log_trace_cache_warnings",
        "zero_optimization.enable_sanity_checks",
    ),
    **_ignored(
        "ShardSpeed loads checkpoints one slice per rank; there is no pipelined loader",
        "zero_optimization.pipeline_loading_checkpoint",
    ),
    **_refused(
        "zero_optimization.load_from_fp32_weights",
        "restoring the fp32 masters from the 16-bit weights is not implemented; ShardSpeed "
        "always restores the fp32 masters saved in the checkpoint",
        "true",
        "remove the key",
    ),
    **_refused(
        "zero_optimization.zero_quantized_nontrainable_weights",
        "storing frozen weights quantized is not implemented",
        "false",
        "remove the key",
    ),
    **_refused(
        "zero_optimization.compute_grad_norm",
        "skipping the global gradient norm is not implemented (clipping and overflow checks "
        "need it)",
        "true",
        "remove the key",
    ),
    **_refused(
        "zero_optimization.zenflow",
        "ZenFlow (delayed updates of unimportant parameters) is not implemented",
        "null",
        "remove the zenflow block",
    ),
    # -- activation checkpointing and pipeline -------------------------------------------------
    **_used(
        "shardspeed.checkpointing.configure",
        "activation_checkpointing.partition_activations",
        "activation_checkpointing.cpu_checkpointing",
        "activation_checkpointing.synchronize_checkpoint_boundary",
        "activation_checkpointing.profile",
    ),
    **_ignored(
        "a memory-fragmentation knob; ShardSpeed stores checkpointed activations as ordinary "
        "tensors (the pair is still checked for consistency)",
        "activation_checkpointing.contiguous_memory_optimization",
        "activation_checkpointing.number_checkpoints",
    ),
    **_used(
        "the pipeline engine",
        "pipeline.stages",
        "pipeline.schedule",
        "pipeline.reshard_after_forward",
    ),
    **_ignored(
        _PIPE_MODULE,
        "pipeline.partition",
        "pipeline.seed_layers",
        "pipeline.activation_checkpoint_interval",
    ),
    **_ignored(
        "partitions pipeline messages over tensor-parallel ranks, which do not exist yet",
        "pipeline.pipe_partitioned",
        "pipeline.grad_partitioned",
    ),
    **_ignored(
        "ShardSpeed's pipeline checkpoints with non-reentrant torch.utils.checkpoint; the "
        "gradients are the same",
        "pipeline.use_reentrant",
    ),
    # -- parallelism ---------------------------------------------------------------------------
    **_refused(
        "tensor_parallel.tp.tp_size",
        _TP,
        "1",
        "set tensor_parallel.autotp_size instead (AutoTP training)",
        _at_most_one,
    ),
    **_used(
        "runtime/initialize.py (AutoTP: shardspeed.parallel.tensor)",
        "tensor_parallel.autotp_size",
        "tensor_parallel.partition_config",
        "tensor_parallel.preset_model",
    ),
    **_ignored(
        _TP_OFF,
        "tensor_parallel.tp_overlap_comm",
        "tensor_parallel.dtype",
        "tensor_parallel.tp.tp_grain_size",
        "tensor_parallel.keep_module_on_host",
    ),
    **_ignored(
        "an inference option (kernel injection); use shardspeed.init_inference",
        "tensor_parallel.replace_with_kernel_inject",
    ),
    **_used(
        "runtime/hybrid.py (generate on the training engine; ZeRO-3 gathers once per call "
        "with pin_parameters, per unit and step without)",
        "hybrid_engine.enabled",
        "hybrid_engine.pin_parameters",
    ),
    **_used("runtime/engine.py (the clipping norm of expert groups)", "moe.grad_norm"),
    **_used(
        "runtime/compile_step.py (torch.compile of the model's forward; at ZeRO-3 of each "
        "unit's forward, runtime/compile_units.py)",
        "compile.enabled",
        "compile.backend",
        "compile.kwargs",
    ),
    **_refused(
        "compile.deepcompile",
        "DeepCompile's graph passes (ZeRO ops rewritten into the compiled graph) are not "
        "implemented",
        "false",
        'set "deepcompile": false and "enabled": true to compile the model\'s forward',
    ),
    **_ignored("a DeepCompile option; DeepCompile is not implemented", *DEEPCOMPILE_KNOBS),
    **_used(
        "runtime/engine.py (DeepSpeed's zero-gradient optimizer step at 16-bit ZeRO 0)",
        "initial_zero_grad_step",
    ),
    **_refused(
        "hybrid_engine.inference_tp_size",
        "tensor-parallel generation inside the hybrid engine is not implemented",
        "1",
        "remove the key (generation runs on each rank's gathered weights); serve a TP model "
        "with shardspeed.init_inference",
        _at_most_one,
    ),
    **_ignored(
        "a generation workspace/caching knob: the hybrid engine runs the model's own generate, "
        "whose KV cache is allocated per call and freed after it",
        "hybrid_engine.max_out_tokens",
        "hybrid_engine.release_inference_cache",
        "hybrid_engine.tp_gather_partition_size",
        "hybrid_engine.enable_cuda_graph",
    ),
    **_used(
        "runtime/initialize.py (the mesh's sequence axis; ZeRO over data x sequence)",
        "sequence_parallel_size",
    ),
    **_ignored(
        "the data-parallel degree is derived from the world size and the pipeline degree",
        "data_parallel_size",
    ),
    **_refused(
        "use_data_before_expert_parallelism",
        "the data-before-expert rank order is not implemented; it changes which ranks form "
        "the expert groups (and where expert weights are saved)",
        "false",
        "remove the key",
    ),
    **_used(
        "shardspeed.ops.sparse_attention.sparsity_config_from_config (model code builds its "
        "block-sparse layout from the block; the engine itself does not read it)",
        "sparse_attention.mode",
        "sparse_attention.block",
        "sparse_attention.different_layout_per_head",
        "sparse_attention.num_local_blocks",
        "sparse_attention.num_global_blocks",
        "sparse_attention.attention",
        "sparse_attention.horizontal_global_attention",
        "sparse_attention.num_different_global_patterns",
        "sparse_attention.num_random_blocks",
        "sparse_attention.local_window_blocks",
        "sparse_attention.global_block_indices",
        "sparse_attention.global_block_end_indices",
        "sparse_attention.num_sliding_window_blocks",
    ),
    # -- monitoring and profiling --------------------------------------------------------------
    **_used(
        "the step reporter / monitors / comms logger",
        "flops_profiler.enabled",
        "flops_profiler.recompute_fwd_factor",
        "flops_profiler.profile_step",
        "flops_profiler.module_depth",
        "flops_profiler.top_modules",
        "flops_profiler.detailed",
        "flops_profiler.output_file",
        "comms_logger.enabled",
        "comms_logger.verbose",
        "comms_logger.prof_all",
        "comms_logger.debug",
        "comms_logger.prof_ops",
        *(
            f"{block}.{key}"
            for block in ("tensorboard", "csv_monitor", "jsonl_monitor")
            for key in ("enabled", "output_path", "job_name")
        ),
        "wandb.enabled",
        "wandb.group",
        "wandb.team",
        "wandb.project",
        "collective_check.enabled",
        "collective_check.interval",
        "collective_check.history",
    ),
    **_refused(
        "comet.enabled",
        "ShardSpeed has no Comet monitor",
        "false",
        "set comet.enabled to false and use wandb, tensorboard, csv_monitor or jsonl_monitor",
    ),
    **_ignored(
        _COMET_OFF,
        "comet.samples_log_interval",
        "comet.project",
        "comet.workspace",
        "comet.api_key",
        "comet.experiment_name",
        "comet.experiment_key",
        "comet.online",
        "comet.mode",
    ),
    **_ignored(
        "ShardSpeed's throughput is reported by steps_per_print / wall_clock_breakdown",
        "timers.throughput.enabled",
        "timers.throughput.synchronized",
    ),
    # -- checkpointing and I/O -----------------------------------------------------------------
    **_used(
        "the checkpoint writer / NVMe swapper",
        "checkpoint.writer",
        "checkpoint.async_save",
        "checkpoint.fsync",
        "checkpoint.layout",
        "checkpoint.load_universal",
        "aio.block_size",
        "aio.intra_op_parallelism",
    ),
    **_ignored(
        "rank 0 picks the save directory for every rank, so ranks cannot disagree on the tag",
        "checkpoint.tag_validation",
    ),
    **_ignored(
        "every rank writes under save_dir, which must be on a shared filesystem",
        "checkpoint.use_node_local_storage",
    ),
    **_ignored(
        "a checkpoint write-speed knob; every rank already writes its own file in parallel",
        "checkpoint.parallel_write.pipeline_stage",
        "checkpoint.checkpoint_serialization",
    ),
    **_ignored(
        _NVME_TUNING,
        "aio.queue_depth",
        "aio.single_submit",
        "aio.overlap_events",
        "aio.use_gds",
    ),
    **_ignored(
        "Python's garbage collector stays on; it cannot change training",
        "disable_python_gc",
    ),
    # -- compression_training (shardspeed.compression: init_compression, the engine's hook) --
    **_used(
        "shardspeed.compression (init_compression / redundancy_clean and the engine's "
        "compression scheduler)",
        "compression_training.weight_quantization.different_groups",
        "compression_training.weight_quantization.shared_parameters.enabled",
        "compression_training.weight_quantization.shared_parameters.schedule_offset",
        "compression_training.activation_quantization.different_groups",
        "compression_training.activation_quantization.shared_parameters.enabled",
        "compression_training.activation_quantization.shared_parameters.schedule_offset",
        "compression_training.sparse_pruning.different_groups",
        "compression_training.sparse_pruning.shared_parameters.enabled",
        "compression_training.sparse_pruning.shared_parameters.schedule_offset",
        "compression_training.row_pruning.different_groups",
        "compression_training.row_pruning.shared_parameters.enabled",
        "compression_training.row_pruning.shared_parameters.schedule_offset",
        "compression_training.head_pruning.different_groups",
        "compression_training.head_pruning.shared_parameters.enabled",
        "compression_training.head_pruning.shared_parameters.schedule_offset",
        "compression_training.channel_pruning.different_groups",
        "compression_training.channel_pruning.shared_parameters.enabled",
        "compression_training.channel_pruning.shared_parameters.schedule_offset",
        "compression_training.weight_quantization.shared_parameters.quantize_groups",
        "compression_training.weight_quantization.shared_parameters.quantization_type",
        "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward",
        "compression_training.weight_quantization.shared_parameters.rounding",
        "compression_training.weight_quantization.shared_parameters.fp16_mixed_quantize.enabled",
        "compression_training.weight_quantization.shared_parameters.fp16_mixed_quantize.quantize_change_ratio",
        "compression_training.activation_quantization.shared_parameters.quantization_type",
        "compression_training.activation_quantization.shared_parameters.range_calibration",
        "compression_training.sparse_pruning.shared_parameters.method",
        "compression_training.sparse_pruning.shared_parameters.schedule_offset_end",
        "compression_training.row_pruning.shared_parameters.method",
        "compression_training.head_pruning.shared_parameters.method",
        "compression_training.head_pruning.shared_parameters.num_heads",
        "compression_training.channel_pruning.shared_parameters.method",
        "compression_training.layer_reduction.enabled",
        "compression_training.layer_reduction.keep_number_layer",
        "compression_training.layer_reduction.module_name_prefix",
        "compression_training.layer_reduction.teacher_layer",
        "compression_training.layer_reduction.other_module_name",
    ),
    **_ignored(
        "logging only (each bit drop is logged)",
        "compression_training.weight_quantization.shared_parameters.quantize_verbose",
    ),
    **_refused(
        "compression_training.weight_quantization.shared_parameters.quantizer_kernel",
        "DeepSpeed's CUDA quantizer kernel is not implemented; ShardSpeed quantizes with "
        "PyTorch ops (same levels)",
        "false",
        "set quantizer_kernel to false or remove it",
        accepts=lambda value, _config: not value,
    ),
    # -- elasticity (computes the batch keys per world size; shardspeed.config.elasticity) -----
    **_used(
        "the elastic batch search (shardspeed.elasticity), which sets the batch keys",
        "elasticity.enabled",
        "elasticity.max_train_batch_size",
        "elasticity.micro_batch_sizes",
        "elasticity.min_gpus",
        "elasticity.max_gpus",
        "elasticity.num_gpus_per_node",
        "elasticity.model_parallel_size",
        "elasticity.prefer_larger_batch",
        "elasticity.ignore_non_elastic_batch_info",
        "elasticity.version",
    ),
    **_ignored(
        "read only by a resource scheduler deciding when to rescale the job (as in DeepSpeed, "
        "the training run never uses it)",
        "elasticity.min_time",
    ),
    # -- accepted-but-unmodelled top-level keys (acted on by shardspeed.config.legacy) ---------
    **{
        key: KeyRule(
            KeyStatus.REFUSED if entry.reject_when_enabled else KeyStatus.IGNORED_KNOB,
            entry.reason,
            allowed="a disabled block" if entry.reject_when_enabled else "",
            fix=entry.fix,
        )
        for key, entry in UNMODELLED_KEYS.items()
    },
}
"""Dotted ds_config key path -> its :class:`KeyRule` (one entry per accepted key)."""

LEGACY_KEY_PATHS: dict[str, str] = {
    "allgather_size": "zero_optimization.allgather_bucket_size",
    "zero_optimization.cpu_offload": "zero_optimization.offload_optimizer.device",
    "zero_optimization.cpu_offload_param": "zero_optimization.offload_param.device",
    "zero_optimization.cpu_offload_use_pin_memory": "zero_optimization.offload_optimizer.pin_memory",
}
"""Legacy keys rewritten by the models' preprocessing (not ``key_aliases``) -> their key."""


# ----------------------------------------------------------------------------------------------
# Applying the registry
# ----------------------------------------------------------------------------------------------


def check_key_status(config: ConfigModel) -> None:
    """Raise for REFUSED keys with a non-accepted value; warn once per IGNORED_KNOB key set.

    ``config`` is a validated ``ShardSpeedConfig``; "set" means given by the user (pydantic's
    ``model_fields_set``, so ``"auto"`` values, which fall back to the default, do not count).

    Raises:
        ConfigError: listing every refused key, its value, what is allowed and the fix.
    """
    issues: list[ConfigIssue] = []
    ignored: list[str] = []
    _visit(config, "", config, issues, ignored)
    if issues:
        raise ConfigError.from_issues(issues)
    for path in ignored:
        warning_once(
            f"ds_config key '{path}' has no effect in ShardSpeed: {KEY_STATUS[path].reason}.",
            name=__name__,
        )


def _visit(
    model: ConfigModel, prefix: str, root: Any, issues: list[ConfigIssue], ignored: list[str]
) -> None:
    for name, field in type(model).model_fields.items():
        path = join_path(prefix, name)
        value = getattr(model, name)
        if isinstance(value, ConfigModel):
            _visit(value, path, root, issues, ignored)
            continue
        if value is None and model_in(field.annotation) is not None:
            continue  # an optional block that was not given (optimizer, offload_param, ...)
        rule = KEY_STATUS.get(path)
        assert rule is not None, f"ds_config key {path} has no entry in KEY_STATUS"
        if rule.status is KeyStatus.REFUSED:
            default = field.get_default(call_default_factory=True)
            ok = rule.accepts(value, root) if rule.accepts else value == default
            if not ok:
                issues.append(
                    ConfigIssue(path, explain(rule.reason, value, rule.allowed, rule.fix))
                )
        elif rule.status is KeyStatus.IGNORED_KNOB and name in model.model_fields_set:
            ignored.append(path)


def keys_with_status(status: KeyStatus) -> dict[str, KeyRule]:
    """The registry entries with one status (for docs and tests)."""
    return {path: rule for path, rule in KEY_STATUS.items() if rule.status is status}


def markdown_table(status: KeyStatus) -> str:
    """A Markdown table of the keys with ``status`` (used to write docs/config.md)."""
    refused = status is KeyStatus.REFUSED
    header = "| Key | Why | Allowed | Fix |" if refused else "| Key | Why it has no effect |"
    rows = [header, "| --- | --- | --- | --- |" if refused else "| --- | --- |"]
    for path, rule in sorted(keys_with_status(status).items()):
        cells = [f"`{path}`", rule.reason] + ([rule.allowed, rule.fix] if refused else [])
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)
