"""shardspeed.config: defaults, batch resolution, "auto", legacy aliases, convenience views."""

from __future__ import annotations

import copy
import itertools
import logging
import pickle
import sys

import pytest
import torch

from shardspeed.config import (
    ActivationCheckpointingConfig,
    BF16Config,
    CommsLoggerConfig,
    ConfigError,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    ShardSpeedConfig,
    ZeroConfig,
    load_config,
    resolve_batch_triple,
)

# ---------------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------------


def test_every_section_parses_its_defaults():
    cfg = load_config({"train_batch_size": 8})
    assert cfg.train_batch_size == 8
    assert cfg.train_micro_batch_size_per_gpu is None and cfg.gradient_accumulation_steps is None
    assert cfg.steps_per_print == 10
    assert cfg.gradient_clipping == 1.0
    assert cfg.wall_clock_breakdown is False and cfg.memory_breakdown is False
    assert cfg.dump_state is False and cfg.prescale_gradients is False
    assert cfg.gradient_predivide_factor == 1.0 and cfg.gradient_allreduce_op == "mean"
    assert cfg.communication_data_type is None and cfg.communication_dtype() is None
    assert cfg.data_types.grad_accum_dtype is None
    assert cfg.zero_allow_untested_optimizer is False and cfg.zero_force_ds_cpu_optimizer is True
    assert cfg.dataloader_drop_last is False
    assert cfg.optimizer is None and cfg.scheduler is None
    assert isinstance(cfg.fp16, FP16Config) and isinstance(cfg.bf16, BF16Config)
    assert (cfg.fp16.enabled, cfg.fp16.loss_scale, cfg.fp16.initial_scale_power) == (False, 0, 16)
    assert (cfg.fp16.loss_scale_window, cfg.fp16.hysteresis, cfg.fp16.min_loss_scale) == (
        1000,
        2,
        1,
    )
    assert cfg.fp16.consecutive_hysteresis is False and cfg.fp16.auto_cast is False
    assert cfg.bf16.immediate_grad_update is False and cfg.bf16.check_grad_overflow is True
    assert not cfg.fp16_enabled and not cfg.bf16_enabled and cfg.train_dtype() == torch.float32

    zero = cfg.zero_optimization
    assert isinstance(zero, ZeroConfig) and cfg.zero_stage == 0 and not cfg.zero_enabled
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.overlap_comm is True and zero.contiguous_gradients and zero.reduce_scatter
    assert zero.offload_optimizer is None and zero.offload_param is None
    assert zero.offload_optimizer_device == "none" and zero.offload_param_device == "none"
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert zero.sub_group_size == 1_000_000_000 and zero.zero_hpz_partition_size == 1

    assert isinstance(cfg.activation_checkpointing, ActivationCheckpointingConfig)
    assert cfg.activation_checkpointing.number_checkpoints is None
    assert isinstance(cfg.pipeline, PipelineConfig)
    assert (cfg.pipeline.stages, cfg.pipeline.partition) == ("auto", "best")
    assert cfg.pipeline.activation_checkpoint_interval == 0 and cfg.pipeline.use_reentrant
    assert isinstance(cfg.flops_profiler, FlopsProfilerConfig)
    assert (cfg.flops_profiler.profile_step, cfg.flops_profiler.module_depth) == (1, -1)
    assert isinstance(cfg.comms_logger, CommsLoggerConfig)
    assert cfg.comms_logger.prof_all and cfg.comms_logger.prof_ops == []
    assert cfg.tensorboard.job_name == "DeepSpeedJobName" and not cfg.tensorboard.enabled
    assert cfg.wandb.project == "deepspeed" and cfg.csv_monitor.output_path == ""
    assert cfg.jsonl_monitor.enabled is False and cfg.jsonl_monitor.job_name
    assert cfg.comet.samples_log_interval == 100
    assert isinstance(cfg.monitor_config, MonitorConfig) and not cfg.monitor_config.enabled
    assert cfg.checkpoint.tag_validation == "Warn" and not cfg.checkpoint.load_universal
    assert cfg.aio.block_size == 1048576 and cfg.aio.queue_depth == 8
    assert cfg.timers.throughput.enabled and cfg.timers.throughput.synchronized
    assert cfg.tensor_parallel.autotp_size == 0 and cfg.tensor_parallel.tp.tp_size == 1
    assert cfg.hybrid_engine.enabled is False and cfg.hybrid_engine.max_out_tokens == 512
    assert cfg.sparse_attention is None and cfg.ignored_keys == {}
    assert cfg.raw == {"train_batch_size": 8}


def test_json_schema_still_builds():
    schema = ShardSpeedConfig.model_json_schema()
    assert "zero_optimization" in schema["properties"]
    zero = schema["$defs"]["ZeroConfig"]["properties"]["reduce_bucket_size"]
    assert zero["description"]


def test_every_field_has_a_description():
    from shardspeed.config.base import ConfigModel, model_in

    seen: set[type] = set()
    todo: list[type[ConfigModel]] = [ShardSpeedConfig, MonitorConfig]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"
            sub = model_in(field.annotation)
            if sub is not None:
                todo.append(sub)
    assert len(seen) > 20


# ---------------------------------------------------------------------------------------------
# Batch triple
# ---------------------------------------------------------------------------------------------

MICRO, GAS = 2, 3


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize(
    "given",
    list(itertools.product([False, True], repeat=3)),
    ids=lambda g: "".join("TMG"[i] if x else "-" for i, x in enumerate(g)),
)
def test_batch_triple_all_combinations(given, dp):
    tbs = MICRO * GAS * dp
    full = {
        "train_batch_size": tbs,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
    }
    source = {k: v for (k, v), keep in zip(full.items(), given) if keep}
    has_tbs, has_micro, has_gas = given
    if not has_tbs and not has_micro:
        with pytest.raises(ConfigError, match="either 'train_batch_size' or"):
            load_config(source, dp_world_size=dp)
        return
    cfg = load_config(source, dp_world_size=dp)
    if has_tbs and not has_micro and not has_gas:
        expected = (tbs, tbs // dp, 1)
    elif has_micro and not has_tbs and not has_gas:
        expected = (MICRO * dp, MICRO, 1)
    else:
        expected = (tbs, MICRO, GAS)
    got = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    assert got == expected
    assert all(type(v) is int for v in got)
    assert cfg.batch_resolved and cfg.dp_world_size == dp


def test_batch_inconsistent_message_has_every_number():
    source = {
        "train_batch_size": 10,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
    }
    with pytest.raises(ConfigError) as info:
        load_config(source, dp_world_size=1)
    assert (
        "train_batch_size (10) must equal train_micro_batch_size_per_gpu (3) * "
        "gradient_accumulation_steps (2) * data-parallel world size (1) = 6"
    ) in str(info.value)
    assert info.value.issues[0].path == "train_batch_size"
    assert "set train_batch_size to 6" in str(info.value)


def test_batch_inconsistent_with_world_size():
    source = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}
    assert load_config(source, dp_world_size=2).gradient_accumulation_steps == 4
    with pytest.raises(ConfigError) as info:  # 16 // 2 // 3 = 2 -> 2 * 2 * 3 = 12 != 16
        load_config(source, dp_world_size=3)
    text = str(info.value)
    assert "train_batch_size (16) must equal" in text and "world size (3) = 12" in text
    assert "derived" in text and "16 // 2 // 3 = 2" in text


def test_batch_micro_not_dividing_and_too_small():
    with pytest.raises(ConfigError, match=r"\(10\) must equal .*\(3\) .*\(3\) .*\(1\) = 9"):
        load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3}, dp_world_size=1)
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 2}, dp_world_size=4)
    assert info.value.issues[0].path == "train_micro_batch_size_per_gpu"
    assert "derived as 0" in str(info.value) and "at least 4" in str(info.value)
    with pytest.raises(ConfigError, match="lower train_micro_batch_size_per_gpu to at most 2"):
        load_config({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}, dp_world_size=2)


def test_batch_checked_without_world_size_when_all_three_given():
    with pytest.raises(ConfigError, match=r"\(10\) must be a multiple of .*\(3\) .*\(2\) = 6"):
        load_config(
            {
                "train_batch_size": 10,
                "train_micro_batch_size_per_gpu": 3,
                "gradient_accumulation_steps": 2,
            }
        )


def test_resolve_batch_returns_copy_and_can_re_resolve():
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})
    four = cfg.resolve_batch(4)
    assert cfg.train_batch_size is None and not cfg.batch_resolved
    assert four.train_batch_size == 24
    two = load_config(four, dp_world_size=2)  # re-resolved from the user's values
    assert two.train_batch_size == 12 and four.train_batch_size == 24
    assert load_config(four) is four
    assert four.raw == cfg.raw


def test_resolve_batch_rejects_bad_world_size():
    with pytest.raises(ConfigError, match="dp_world_size must be a positive integer"):
        resolve_batch_triple(8, None, None, 0)


# ---------------------------------------------------------------------------------------------
# "auto", numbers, aliases, legacy keys
# ---------------------------------------------------------------------------------------------


def test_auto_values_resolve_to_defaults():
    cfg = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "fp16": {"enabled": "auto", "loss_scale_window": 500},
            "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "eps": 1e-6}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "AUTO"}},
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
            "pipeline": {"stages": "auto"},
        },
        dp_world_size=2,
    )
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)
    assert cfg.gradient_clipping == 1.0 and not cfg.fp16.enabled and not cfg.bf16.enabled
    assert cfg.fp16.loss_scale_window == 500
    assert cfg.optimizer.params == {"eps": 1e-6} and cfg.scheduler.params == {}
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.pipeline.stages == "auto"
    assert cfg.raw["optimizer"]["params"]["lr"] == "auto"  # raw keeps what the user wrote


def test_scientific_notation_for_integers():
    cfg = load_config(
        {
            "train_batch_size": 8.0,
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 2e8,
                "allgather_bucket_size": "5e8",
                "stage3_max_live_parameters": 1e9,
                "sub_group_size": 1_000_000_000_000,
            },
        }
    )
    zero = cfg.zero_optimization
    assert zero.reduce_bucket_size == 200_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.allgather_bucket_size == 500_000_000
    assert zero.stage3_max_live_parameters == 1_000_000_000 and cfg.train_batch_size == 8


def test_stage3_short_aliases():
    long = load_config(
        {
            "train_batch_size": 8,
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1234},
        }
    )
    short = load_config(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": 1234,
                "param_persistence_threshold": 77,
                "max_live_parameters": 9,
                "max_reuse_distance": 8,
                "gather_16bit_weights_on_model_save": True,
            },
        }
    )
    assert long.zero_optimization.stage3_prefetch_bucket_size == 1234
    zero = short.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 1234 and zero.prefetch_bucket_size == 1234
    assert zero.stage3_param_persistence_threshold == 77 and zero.param_persistence_threshold == 77
    assert zero.stage3_max_live_parameters == 9 and zero.stage3_max_reuse_distance == 8
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    same = load_config(
        {
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": 5,
                "stage3_prefetch_bucket_size": 5,
            }
        }
    )
    assert same.zero_optimization.stage3_prefetch_bucket_size == 5


def test_legacy_zero_keys():
    cfg = load_config(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": False,
                "stage3_gather_fp16_weights_on_model_save": True,
            },
        }
    )
    zero = cfg.zero_optimization
    assert isinstance(zero.offload_optimizer, OffloadOptimizerConfig)
    assert isinstance(zero.offload_param, OffloadParamConfig)
    assert zero.offload_optimizer.device == "cpu" and zero.offload_param.device == "cpu"
    assert zero.offload_optimizer.pin_memory is False and zero.offload_param.pin_memory is False
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    off = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert off.zero_optimization.offload_optimizer is None


def test_legacy_zero_bool_and_bfloat16():
    assert load_config({"train_batch_size": 1, "zero_optimization": True}).zero_stage == 1
    assert load_config({"train_batch_size": 1, "zero_optimization": False}).zero_stage == 0
    cfg = load_config({"train_batch_size": 1, "bfloat16": {"enabled": True}})
    assert cfg.bf16_enabled and cfg.bf16.enabled and cfg.train_dtype() == torch.bfloat16
    assert cfg.raw == {"train_batch_size": 1, "bfloat16": {"enabled": True}}


def test_other_aliases():
    cfg = load_config(
        {
            "seq_parallel_comm_data_type": "bf16",
            "aio": {"thread_count": 4},
            "checkpoint": {"tag_validation": "FAIL"},
            "communication_data_type": "float16",
            "data_types": {"grad_accum_dtype": "torch.float32"},
        }
    )
    assert cfg.seq_parallel_communication_data_type == "bf16"
    assert cfg.aio.intra_op_parallelism == 4 and cfg.checkpoint.tag_validation == "Fail"
    assert cfg.communication_data_type == "fp16" and cfg.communication_dtype() == torch.float16
    assert cfg.data_types.grad_accum_dtype == "fp32"


def test_overlap_comm_defaults_to_true_at_every_stage():
    assert load_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is True
    auto = load_config({"zero_optimization": {"stage": 1, "overlap_comm": "auto"}})
    assert auto.zero_optimization.overlap_comm is True
    null = load_config({"zero_optimization": {"stage": 0, "overlap_comm": None}})
    assert null.zero_optimization.overlap_comm is True
    explicit = load_config({"zero_optimization": {"stage": 3, "overlap_comm": False}})
    assert explicit.zero_optimization.overlap_comm is False


def test_optimizer_and_scheduler_names_are_canonical():
    cfg = load_config(
        {
            "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
            "scheduler": {
                "type": "warmupdecaylr",
                "params": {"total_num_steps": 1e3, "warmup_num_steps": 10},
            },
        }
    )
    assert isinstance(cfg.optimizer, OptimizerConfig) and cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params["betas"] == [0.9, 0.95] and cfg.optimizer.legacy_fusion is False
    assert isinstance(cfg.scheduler, SchedulerConfig) and cfg.scheduler.type == "WarmupDecayLR"
    assert cfg.scheduler.params["total_num_steps"] == 1000
    for name, canonical in [("rmsprop", "RMSprop"), ("OneBitAdam", "OneBitAdam"), ("lion", "Lion")]:
        assert load_config({"optimizer": {"type": name}}).optimizer.type == canonical


def test_user_dict_is_not_modified():
    source = {
        "train_batch_size": "auto",
        "zero_optimization": {"stage": 3, "cpu_offload": True, "prefetch_bucket_size": 3},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 5.0, "warmup_max_lr": "auto"},
        },
        "autotuning": {"enabled": False},
    }
    before = copy.deepcopy(source)
    cfg = load_config(source, dp_world_size=None)
    assert source == before and cfg.raw == before and cfg.raw is not source


def test_unmodelled_keys_are_warned_about_not_dropped():
    from shardspeed.utils import logging as ss_logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger("shardspeed")
    root.addHandler(handler)
    try:
        ss_logging._once.cache_clear()
        cfg = load_config(
            {
                "autotuning": {"enabled": True},
                "curriculum_learning": {"enabled": False},
                "zero_optimization": {"stage": 1},
            }
        )
    finally:
        root.removeHandler(handler)
    assert set(cfg.ignored_keys) == {"autotuning", "curriculum_learning"}
    messages = " ".join(r.getMessage() for r in records if r.levelno == logging.WARNING)
    assert "'autotuning' is accepted but ignored" in messages
    assert "'curriculum_learning' is accepted but ignored" in messages


def test_misc_views():
    cfg = load_config(
        {
            "flops_profiler": {"enabled": True},
            "csv_monitor": {"enabled": True, "output_path": "/tmp/x"},
            "sparse_attention": {"mode": "BigBird", "block": 32},
        }
    )
    assert cfg.wall_clock_breakdown is True  # flops profiler forces the breakdown on
    assert cfg.monitor_config.enabled and cfg.monitor_config.csv_monitor.output_path == "/tmp/x"
    assert cfg.sparse_attention.mode == "bigbird" and cfg.sparse_attention.block == 32
    clone = pickle.loads(pickle.dumps(cfg))
    assert clone == cfg and clone.raw == cfg.raw


def test_direct_construction_matches_load_config():
    direct = ShardSpeedConfig(train_batch_size=8, bfloat16={"enabled": True})
    assert direct.bf16_enabled and direct.raw == {
        "train_batch_size": 8,
        "bfloat16": {"enabled": True},
    }
    zero = ZeroConfig(stage=3, offload_param={"device": "cpu"})
    assert zero.offload_param_device == "cpu" and zero.overlap_comm is True
