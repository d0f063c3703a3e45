"""shardspeed.config: every bad input gives a ConfigError naming path, value, allowed and fix."""

from __future__ import annotations

import logging

import pytest

from shardspeed.config import ConfigError, OffloadOptimizerConfig, ZeroConfig, load_config


def error_for(source, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


def paths(err: ConfigError) -> list[str]:
    return [issue.path for issue in err.issues]


def test_unknown_nested_key_did_you_mean():
    err = error_for({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}})
    assert paths(err) == ["zero_optimization.reduce_bucket_sise"]
    assert "unknown key" in str(err) and "did you mean 'reduce_bucket_size'?" in str(err)


def warned_for(source, caplog) -> str:
    """Load ``source`` (which must succeed) and return the warnings it logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_config(source)
    return caplog.text


def test_unknown_top_level_key_is_ignored_with_did_you_mean(caplog):
    # DeepSpeed ignores unknown top-level keys; ShardSpeed too, but never silently
    text = warned_for({"train_batch_size": 8, "zero_optimisation": {"stage": 2}}, caplog)
    assert "'zero_optimisation' is unknown and ignored" in text
    assert "did you mean 'zero_optimization'?" in text


def test_dotted_top_level_key_names_the_nested_key(caplog):
    # what TRL's prepare_deepspeed writes for its reference model at ZeRO-3
    config = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3},
        "zero_optimization.reduce_bucket_size": 4096,
        "zero_optimization.stage3_prefetch_bucket_size": 3686.4,
    }
    text = warned_for(config, caplog)
    assert "'zero_optimization.reduce_bucket_size' is unknown and ignored" in text
    assert '{"zero_optimization": {"reduce_bucket_size": ...}}' in text
    assert "'zero_optimization.stage3_prefetch_bucket_size'" in text
    loaded = load_config(config)
    assert "zero_optimization.reduce_bucket_size" in loaded.ignored_keys


def test_unknown_top_level_key_without_match(caplog):
    text = warned_for({"qwertyuiop": 1}, caplog)
    assert "'qwertyuiop' is unknown and ignored" in text and "correct the spelling" in text


def test_misplaced_key_points_to_its_block(caplog):
    text = warned_for({"train_batch_size": 8, "offload_optimizer": {"device": "cpu"}}, caplog)
    assert "did you mean 'zero_optimization.offload_optimizer'?" in text


def test_strict_mode_refuses_unknown_top_level_keys(monkeypatch):
    monkeypatch.setenv("SHARDSPEED_STRICT_CONFIG", "1")
    err = error_for({"train_batch_size": 8, "zero_optimisation": {"stage": 2}, "qwertyuiop": 1})
    assert paths(err) == ["zero_optimisation", "qwertyuiop"]
    assert "did you mean 'zero_optimization'?" in str(err) and "got 1" in str(err)


def test_bad_zero_stage():
    err = error_for({"zero_optimization": {"stage": 4}})
    assert paths(err) == ["zero_optimization.stage"]
    assert "(got 4)" in str(err) and "0, 1, 2 or 3" in str(err)


def test_bad_offload_device():
    err = error_for({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}})
    assert paths(err) == ["zero_optimization.offload_optimizer.device"]
    assert '(got "gpu")' in str(err) and "'none', 'cpu' or 'nvme'" in str(err)
    assert 'default "none"' in str(err)


def test_nvme_without_path():
    err = error_for({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert paths(err) == ["zero_optimization.offload_param.nvme_path"]
    assert 'device is "nvme"' in str(err) and 'Fix: add "nvme_path"' in str(err)
    with pytest.raises(ConfigError, match="zero_optimization.offload_optimizer.nvme_path"):
        OffloadOptimizerConfig(device="NVMe")


def test_offload_param_needs_stage_3():
    err = error_for({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert paths(err) == ["zero_optimization.offload_param"]
    assert "stage 3 (stage is 2)" in str(err) and '"stage": 3' in str(err)


def test_nvme_optimizer_offload_needs_stage_3_and_offload_needs_zero():
    err = error_for(
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
            }
        }
    )
    assert paths(err) == ["zero_optimization.offload_optimizer.device"]
    assert '"cpu" at stages 1-2' in str(err)
    err = error_for({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "stage 1, 2 or 3 (stage is 0)" in str(err)


def test_fp16_and_bf16_both_enabled():
    err = error_for({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert paths(err) == ["bf16.enabled"]
    assert "cannot both be enabled" in str(err) and "Fix:" in str(err)


def test_max_grad_norm_in_optimizer_params():
    err = error_for({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 0.5}}})
    assert paths(err) == ["optimizer.params.max_grad_norm"]
    assert "(got 0.5)" in str(err) and "use the top-level 'gradient_clipping': 0.5" in str(err)


def test_unknown_optimizer_lists_supported_names():
    err = error_for({"optimizer": {"type": "NotAnOptimizer"}})
    assert paths(err) == ["optimizer.type"]
    text = str(err)
    assert '(got "NotAnOptimizer")' in text
    for name in ("Adam", "AdamW", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "RMSprop"):
        assert name in text
    assert "did you mean 'AdamW'?" in str(error_for({"optimizer": {"type": "AdamWW"}}))


def test_missing_optimizer_type():
    err = error_for({"optimizer": {"params": {"lr": 1e-3}}})
    assert paths(err) == ["optimizer.type"] and "required key is missing" in str(err)


def test_unknown_scheduler_type():
    err = error_for({"scheduler": {"type": "Cosine"}})
    assert paths(err) == ["scheduler.type"]
    text = str(err)
    assert "LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR" in text
    assert "did you mean 'WarmupCosineLR'?" in text


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_scheduler_without_total_num_steps(kind):
    err = error_for({"scheduler": {"type": kind, "params": {"warmup_num_steps": 10}}})
    assert paths(err) == ["scheduler.params.total_num_steps"]
    assert f"required by the {kind} scheduler" in str(err)
    auto = error_for({"scheduler": {"type": kind, "params": {"total_num_steps": "auto"}}})
    assert '"auto" must be replaced by a number' in str(auto)


@pytest.mark.parametrize("steps", [0, -5, 2.5, "ten"])
def test_warmup_num_steps_must_be_positive(steps):
    err = error_for({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": steps}}})
    assert paths(err) == ["scheduler.params.warmup_num_steps"]
    assert "must be a positive integer" in str(err) and "(got " in str(err)


def test_unknown_scheduler_param():
    err = error_for({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_l": 1e-3}}})
    assert paths(err) == ["scheduler.params.warmup_max_l"]
    assert "did you mean 'warmup_max_lr'?" in str(err)


@pytest.mark.parametrize(
    "key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
)
@pytest.mark.parametrize("value", [0, -2])
def test_batch_values_must_be_positive(key, value):
    err = error_for({key: value})
    assert paths(err) == [key] and f"(got {value})" in str(err) and "positive" in str(err)


def test_wrong_types_name_expected_type_and_default():
    err = error_for({"gradient_clipping": "abc"})
    assert paths(err) == ["gradient_clipping"]
    assert '(got "abc")' in str(err) and "use a number" in str(err) and "default 1.0" in str(err)
    err = error_for({"zero_optimization": {"reduce_bucket_size": 1.5}})
    assert "use an integer" in str(err) and "default 500000000" in str(err)
    err = error_for({"fp16": {"hysteresis": True}})
    assert "not a boolean" in str(err)
    err = error_for({"zero_optimization": 5})
    assert "must be a JSON object" in str(err) and "(got 5)" in str(err)


def test_all_errors_are_listed_one_per_line():
    err = error_for(
        {
            "fp16": {"loss_scale_windw": 10, "hysteresis": "x"},
            "zero_optimization": {"stage": 9},
        }
    )
    assert set(paths(err)) == {
        "fp16.loss_scale_windw",
        "fp16.hysteresis",
        "zero_optimization.stage",
    }
    assert "(3 problems)" in str(err) and len(str(err).splitlines()) == 4


def test_removed_blocks_are_rejected_when_enabled():
    err = error_for(
        {"amp": {"enabled": True, "opt_level": "O1"}, "progressive_layer_drop": {"enabled": True}}
    )
    assert paths(err) == ["amp", "progressive_layer_drop"]
    assert "Apex AMP is not supported" in str(err) and '"bf16": {"enabled": true}' in str(err)
    err = error_for({"quantize_training": {"enabled": True}})
    assert paths(err) == ["quantize_training"]


def test_alias_conflict():
    err = error_for(
        {"zero_optimization": {"prefetch_bucket_size": 10, "stage3_prefetch_bucket_size": 20}}
    )
    assert paths(err) == ["zero_optimization.prefetch_bucket_size"]
    assert "prefetch_bucket_size=10, stage3_prefetch_bucket_size=20" in str(err)
    err = error_for({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}})
    assert paths(err) == ["bfloat16"]


def test_legacy_cpu_offload_conflict():
    err = error_for(
        {
            "zero_optimization": {
                "stage": 2,
                "cpu_offload": True,
                "offload_optimizer": {"device": "cpu"},
            }
        }
    )
    assert paths(err) == ["zero_optimization.cpu_offload"]
    assert "keep 'offload_optimizer'" in str(err)


def test_enumerations():
    err = error_for({"communication_data_type": "fp8"})
    assert "'fp32', 'fp16' or 'bf16'" in str(err) and '(got "fp8")' in str(err)
    err = error_for({"gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 3}})
    assert paths(err) == ["gradient_allreduce_op"] and "ZeRO stage 3" in str(err)
    err = error_for({"checkpoint": {"tag_validation": "maybe"}})
    assert "'Ignore', 'Warn' or 'Fail'" in str(err)
    err = error_for({"log_level": "loud"})
    assert paths(err) == ["log_level"] and "debug, info, warning, error, critical" in str(err)


def test_precision_cross_checks():
    err = error_for({"bf16": {"enabled": True, "bf16_optimizer_states": True}})
    assert paths(err) == ["bf16.bf16_optimizer_states"]
    err = error_for({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})
    assert paths(err) == ["fp16.fp16_master_weights_and_grads"] and "ZeRO stage 1" in str(err)


def test_activation_checkpointing_contiguous_needs_count():
    err = error_for({"activation_checkpointing": {"contiguous_memory_optimization": True}})
    assert paths(err) == ["activation_checkpointing.number_checkpoints"]


def test_standalone_block_errors_are_config_errors():
    with pytest.raises(ConfigError) as info:
        ZeroConfig(stage=5)
    assert paths(info.value) == ["zero_optimization.stage"]


def test_bad_source_types():
    err = error_for(12)
    assert "unsupported config type int" in str(err)
