"""Every accepted ds_config key has a status: USED, REFUSED or IGNORED_KNOB (issue 13).

The first tests pin the complete set of accepted key paths against the registry, so a new
field (or alias) cannot be added without deciding what ShardSpeed does with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardspeed.config import ConfigError, ShardSpeedConfig, load_config
from shardspeed.config.base import ConfigModel, model_in
from shardspeed.config.key_status import (
    KEY_STATUS,
    LEGACY_KEY_PATHS,
    KeyStatus,
    keys_with_status,
)
from shardspeed.config.legacy import UNMODELLED_KEYS
from shardspeed.utils import logging as ss_logging

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _leaf_paths(cls: type[ConfigModel], prefix: str = "") -> Iterator[str]:
    for name, field in cls.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        sub = model_in(field.annotation)
        if sub is None:
            yield path
        else:
            yield from _leaf_paths(sub, path)


def _alias_paths(cls: type[ConfigModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    def at(key: str) -> str:
        return f"{prefix}.{key}" if prefix else key

    for old, new in {**cls.key_aliases, **cls.deprecated_keys}.items():
        yield at(old), at(new)
    for name, field in cls.model_fields.items():
        if field.alias and field.alias != name:
            yield at(field.alias), at(name)
        sub = model_in(field.annotation)
        if sub is not None:
            yield from _alias_paths(sub, at(name))


def _nested(path: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    for key in reversed(path.split(".")):
        value = {key: value}
    return value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _default(path: str) -> Any:
    cls: type[ConfigModel] = ShardSpeedConfig
    *blocks, leaf = path.split(".")
    for name in blocks:
        cls = model_in(cls.model_fields[name].annotation)
    return cls.model_fields[leaf].get_default(call_default_factory=True)


@pytest.fixture
def warnings_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog wired to the ``shardspeed`` logger (it does not propagate), once-cache cleared."""
    ss_logging._once.cache_clear()
    logger = logging.getLogger("shardspeed")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        ss_logging._once.cache_clear()


def _warnings_naming(caplog: pytest.LogCaptureFixture, path: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and f"'{path}'" in r.getMessage()
    ]


# ----------------------------------------------------------------------------------------------
# The pinned set of keys
# ----------------------------------------------------------------------------------------------

EXPECTED_ALIASES = {
    "bfloat16": "bf16",
    "seq_parallel_comm_data_type": "seq_parallel_communication_data_type",
    "zero_optimization.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold": (
        "zero_optimization.stage3_param_persistence_threshold"
    ),
    "zero_optimization.model_persistence_threshold": (
        "zero_optimization.stage3_model_persistence_threshold"
    ),
    "zero_optimization.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.gather_16bit_weights_on_model_save": (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ),
    "zero_optimization.module_granularity_threshold": (
        "zero_optimization.stage3_module_granularity_threshold"
    ),
    "zero_optimization.use_all_reduce_for_fetch_params": (
        "zero_optimization.stage3_use_all_reduce_for_fetch_params"
    ),
    "zero_optimization.allgather_sequential": "zero_optimization.stage3_allgather_sequential",
    "zero_optimization.partition_stream_chunk_size": (
        "zero_optimization.stage3_partition_stream_chunk_size"
    ),
    "tensor_parallel.tensor_parallel": "tensor_parallel.tp",
    "tensor_parallel.kernel_inject": "tensor_parallel.replace_with_kernel_inject",
    "aio.thread_count": "aio.intra_op_parallelism",
}

EXPECTED_REFUSED = {
    "managed_gradient_accumulation",
    "gradient_allreduce_op",
    "use_data_before_expert_parallelism",
    "fp16.auto_cast",
    "fp16.fp16_master_weights_and_grads",
    "bf16.bf16_master_weights_and_grads",
    "bf16.bf16_optimizer_states",
    "data_types.param_dtype",
    "data_types.buffer_dtype",
    "data_types.keep_in_fp32_modules",
    "torch_autocast.enabled",
    "zero_optimization.load_from_fp32_weights",
    "zero_optimization.zero_quantized_nontrainable_weights",
    "zero_optimization.zeropp_loco_param",
    "zero_optimization.compute_grad_norm",
    "zero_optimization.zenflow",
    "tensor_parallel.tp.tp_size",
    "hybrid_engine.inference_tp_size",
    "comet.enabled",
    "compile.deepcompile",
    "compression_training.weight_quantization.shared_parameters.quantizer_kernel",
    *(key for key, entry in UNMODELLED_KEYS.items() if entry.reject_when_enabled),
}


def test_registry_covers_exactly_the_accepted_keys():
    accepted = set(_leaf_paths(ShardSpeedConfig)) | set(UNMODELLED_KEYS)
    missing = sorted(accepted - set(KEY_STATUS))
    stale = sorted(set(KEY_STATUS) - accepted)
    assert not missing, f"accepted keys without a status in KEY_STATUS: {missing}"
    assert not stale, f"KEY_STATUS entries for keys the config does not accept: {stale}"


def test_aliases_and_legacy_names_resolve_to_registered_keys():
    aliases = dict(_alias_paths(ShardSpeedConfig))
    assert aliases == EXPECTED_ALIASES
    for alias, target in {**aliases, **LEGACY_KEY_PATHS}.items():
        covered = target in KEY_STATUS or any(k.startswith(target + ".") for k in KEY_STATUS)
        assert covered, f"{alias} -> {target} has no status"


def test_status_counts_and_refused_set_are_pinned():
    counts = {s: len(keys_with_status(s)) for s in KeyStatus}
    assert counts == {KeyStatus.USED: 160, KeyStatus.REFUSED: 30, KeyStatus.IGNORED_KNOB: 103}
    assert set(keys_with_status(KeyStatus.REFUSED)) == EXPECTED_REFUSED
    for path, rule in KEY_STATUS.items():
        assert rule.reason, path
        if rule.status is KeyStatus.REFUSED:
            assert rule.fix, path


def test_used_keys_include_the_core_ones():
    used = keys_with_status(KeyStatus.USED)
    for path in (
        "zero_optimization.stage",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.overlap_comm",
        "gradient_clipping",
        "train_micro_batch_size_per_gpu",
        "bf16.enabled",
        "optimizer.type",
    ):
        assert path in used, path


# ----------------------------------------------------------------------------------------------
# REFUSED
# ----------------------------------------------------------------------------------------------


def test_autotp_size_is_used_now_that_tensor_parallelism_exists():
    # refused until AutoTP training existed (issue 13); issue 14 made it work
    # (tests/dist/test_tp_engine.py trains with it)
    config = load_config({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}})
    assert config.tensor_parallel.autotp_size == 2
    assert KEY_STATUS["tensor_parallel.autotp_size"].status is KeyStatus.USED


REFUSED_VALUES: dict[str, tuple[Any, dict[str, Any]]] = {
    # path: (a refused value, extra config needed to reach the check)
    "managed_gradient_accumulation": (False, {}),
    "gradient_allreduce_op": ("sum", {}),
    "use_data_before_expert_parallelism": (True, {}),
    "fp16.auto_cast": (True, {"fp16": {"enabled": True}}),
    "fp16.fp16_master_weights_and_grads": (True, {"zero_optimization": {"stage": 1}}),
    "bf16.bf16_master_weights_and_grads": (True, {"zero_optimization": {"stage": 1}}),
    "bf16.bf16_optimizer_states": (
        True,
        {"zero_optimization": {"stage": 1}, "bf16": {"bf16_master_weights_and_grads": True}},
    ),
    "data_types.param_dtype": ("fp16", {"bf16": {"enabled": True}}),
    "data_types.buffer_dtype": ("bf16", {}),
    "data_types.keep_in_fp32_modules": (["lm_head"], {}),
    "torch_autocast.enabled": (True, {}),
    "zero_optimization.load_from_fp32_weights": (False, {}),
    "zero_optimization.zero_quantized_nontrainable_weights": (True, {}),
    "zero_optimization.zeropp_loco_param": ({"err_beta": 0.8}, {"zero_optimization": {"stage": 3}}),
    "zero_optimization.compute_grad_norm": (False, {"zero_optimization": {"stage": 2}}),
    "zero_optimization.zenflow": ({"topk_ratio": 0.1}, {}),
    "tensor_parallel.tp.tp_size": (2, {}),
    "compile.deepcompile": (True, {}),
    "hybrid_engine.inference_tp_size": (2, {}),
    "comet.enabled": (True, {}),
    "compression_training.weight_quantization.shared_parameters.quantizer_kernel": (True, {}),
    **{
        key: ({"enabled": True}, {})
        for key, entry in UNMODELLED_KEYS.items()
        if entry.reject_when_enabled
    },
}


def test_every_refused_key_has_a_test_value():
    assert set(REFUSED_VALUES) == EXPECTED_REFUSED


@pytest.mark.parametrize("path", sorted(REFUSED_VALUES))
def test_refused_key_with_a_non_default_value_raises(path: str):
    value, extra = REFUSED_VALUES[path]
    config = _merge(_merge({"train_batch_size": 8}, extra), _nested(path, value))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert path in [i.path for i in info.value.issues], str(info.value)
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize(
    "config",
    [
        {"tensor_parallel": {"autotp_size": 1, "tp": {"tp_size": 1}}},
        {"tensor_parallel": {"autotp_size": 0}},
        {"sequence_parallel_size": 1},
        {"bf16": {"enabled": True}, "data_types": {"param_dtype": "bfloat16"}},
        {"data_types": {"keep_in_fp32_modules": []}},
        {"zero_optimization": {"stage": 2, "zero_quantized_weights": False}},
        {"hybrid_engine": {"enabled": True, "inference_tp_size": 1}, "comet": {"enabled": False}},
        {"amp": {"enabled": False}, "gradient_allreduce_op": "mean"},
    ],
)
def test_refused_keys_accept_their_default_or_harmless_values(config: dict[str, Any]):
    load_config({"train_batch_size": 8, **config})


def test_refused_errors_are_collected_into_one_message():
    with pytest.raises(ConfigError) as info:
        load_config(
            {
                "train_batch_size": 8,
                "tensor_parallel": {"tp": {"tp_size": 2}},
                "hybrid_engine": {"enabled": True, "inference_tp_size": 2},
            }
        )
    paths = [i.path for i in info.value.issues]
    assert sorted(paths) == ["hybrid_engine.inference_tp_size", "tensor_parallel.tp.tp_size"]


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match="hybrid_engine.inference_tp_size"):
        ShardSpeedConfig(train_batch_size=8, hybrid_engine={"inference_tp_size": 2})


# ----------------------------------------------------------------------------------------------
# IGNORED_KNOB
# ----------------------------------------------------------------------------------------------

IGNORED = sorted(keys_with_status(KeyStatus.IGNORED_KNOB))


@pytest.mark.parametrize("path", IGNORED)
def test_ignored_knob_set_explicitly_warns_exactly_once(path: str, warnings_log):
    value = {} if path in UNMODELLED_KEYS else _default(path)
    base: dict[str, Any] = {"train_batch_size": 8, "optimizer": {"type": "AdamW"}}
    config = _merge(base, _nested(path, value))
    load_config(config)
    load_config(config)
    messages = _warnings_naming(warnings_log, path)
    assert len(messages) == 1, messages
    assert "no effect" in messages[0] or "accepted but ignored" in messages[0]


def test_ignored_knobs_do_not_warn_when_absent_or_auto(warnings_log):
    load_config(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "sub_group_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "offload_optimizer": {"device": "cpu"},
            },
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
        }
    )
    knob_warnings = [p for p in IGNORED if _warnings_naming(warnings_log, p)]
    assert knob_warnings == []


def test_ignored_knob_warning_names_the_key_and_why(warnings_log):
    load_config({"train_batch_size": 8, "zero_optimization": {"round_robin_gradients": True}})
    (message,) = _warnings_naming(warnings_log, "zero_optimization.round_robin_gradients")
    assert "has no effect in ShardSpeed" in message and "reduce_bucket_size" in message


def test_aliased_ignored_knob_warns_under_its_canonical_name(warnings_log):
    load_config({"train_batch_size": 8, "aio": {"thread_count": 1, "queue_depth": 4}})
    assert _warnings_naming(warnings_log, "aio.queue_depth")
    assert not _warnings_naming(warnings_log, "aio.intra_op_parallelism")  # USED


# ----------------------------------------------------------------------------------------------
# One source of truth for overlap_comm; the activation_checkpointing block
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_is_true_by_default_at_every_stage(stage: int):
    zero = load_config({"zero_optimization": {"stage": stage}}).zero_optimization
    assert zero.overlap_comm is True
    off = load_config({"zero_optimization": {"stage": stage, "overlap_comm": False}})
    assert off.zero_optimization.overlap_comm is False


def test_activation_checkpointing_given_tells_whether_the_block_was_present():
    assert load_config({"train_batch_size": 8}).activation_checkpointing_given is False
    given = load_config({"train_batch_size": 8, "activation_checkpointing": {}})
    assert given.activation_checkpointing_given is True
    resolved = given.resolve_batch(2)
    assert resolved.activation_checkpointing_given is True
    direct = ShardSpeedConfig(activation_checkpointing={"partition_activations": True})
    assert direct.activation_checkpointing_given is True


# ----------------------------------------------------------------------------------------------
# docs/config.md lists every REFUSED and IGNORED_KNOB key
# ----------------------------------------------------------------------------------------------


def test_docs_list_every_refused_and_ignored_key():
    text = DOCS.read_text(encoding="utf-8")
    for path, rule in KEY_STATUS.items():
        if rule.status is not KeyStatus.USED:
            assert f"`{path}`" in text, f"docs/config.md does not list {path}"
