"""``shardspeed.elasticity`` (DeepSpeed 0.19.6's elastic batch search) and its config wiring.

``compute_elastic_config`` against DeepSpeed 0.19.6's recorded answers is
``tests/unit/test_elasticity_goldens.py`` (goldens in ``tests/goldens/elasticity/``).
``GOLDEN_CONFIG`` is what DeepSpeed's ``DeepSpeedConfig`` wrote into the batch keys: the elastic batch, the micro
batch ``compute_elastic_config`` returned for the world size, and
``batch // (micro * world_size)`` accumulation steps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shardspeed.config import ConfigError, load_config
from shardspeed.elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    constants,
    elasticity_enabled,
    ensure_immutable_elastic_config,
)
from shardspeed.elasticity.search import HCN_LIST, get_valid_gpus
from shardspeed.utils import logging as ss_logging

GOLDEN_CONFIG = [
    # (block, dp world size, DeepSpeed's (train_batch_size, micro, grad_accum_steps))
    ({"max_train_batch_size": 256, "micro_batch_sizes": [4, 8, 16]}, 1, (240, 16, 15)),
    ({"max_train_batch_size": 256, "micro_batch_sizes": [4, 8, 16]}, 2, (240, 8, 15)),
    ({"max_train_batch_size": 256, "micro_batch_sizes": [4, 8, 16]}, 4, (240, 4, 15)),
    ({"max_train_batch_size": 256, "micro_batch_sizes": [4, 8, 16]}, 8, (256, 16, 2)),
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}, 2, (1680, 6, 140)),
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}, 4, (1680, 6, 70)),
]  # fmt: skip

ELASTIC = {"enabled": True, "max_train_batch_size": 256, "micro_batch_sizes": [4, 8, 16]}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(constants.DEEPSPEED_ELASTICITY_CONFIG, raising=False)


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


# ----------------------------------------------------------------------------------------------
# compute_elastic_config against DeepSpeed 0.19.6
# ----------------------------------------------------------------------------------------------


def test_error_types_keep_deepspeeds_hierarchy():
    assert issubclass(ElasticityConfigError, ElasticityError)
    assert issubclass(ElasticityIncompatibleWorldSize, ElasticityError)
    assert issubclass(ElasticityError, ValueError)  # a user mistake, as the house style asks


def test_incompatible_world_size_names_the_valid_counts():
    block = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [8], "version": 0.1}
    with pytest.raises(ElasticityIncompatibleWorldSize, match=r"world size 5 .*\[1, 2, 3, 6\]"):
        compute_elastic_config({"elasticity": block}, "0.19.6", world_size=5)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ([], ValueError, "ds_config must be a dict"),
        ({"train_batch_size": 8}, ElasticityConfigError, "no 'elasticity' block"),
        ({"elasticity": {"enabled": False}}, ElasticityConfigError, "disabled"),
        (
            {"elasticity": {"enabled": True, "micro_batch_sizes": [2]}},
            ElasticityConfigError,
            "max_train_batch_size is required",
        ),
        (
            {"elasticity": {**ELASTIC, "min_gpus": 0}},
            ElasticityConfigError,
            r"min_gpus must be a positive integer \(got 0\)",
        ),
        (
            {"elasticity": {**ELASTIC, "micro_batch_sizes": [2, "4"]}},
            ElasticityConfigError,
            "micro_batch_sizes must hold only positive integers",
        ),
        ({"elasticity": {**ELASTIC, "min_time": -1}}, ElasticityConfigError, "min_time"),
        ({"elasticity": {**ELASTIC, "version": 0.15}}, ElasticityConfigError, "0.1 or 0.2"),
        ({"elasticity": {**ELASTIC, "version": "new"}}, ElasticityConfigError, "a number"),
    ],
)
def test_bad_inputs_name_the_key_and_the_fix(config: Any, error: type[Exception], match: str):
    with pytest.raises(error, match=match) as info:
        compute_elastic_config(config, "0.19.6", world_size=2)
    assert "Fix:" in str(info.value)


def test_target_deepspeed_version_must_have_elasticity():
    config = {"elasticity": {**ELASTIC, "version": 0.1}}
    with pytest.raises(ElasticityError, match="0.3.8"):
        compute_elastic_config(config, "0.3.7")
    assert compute_elastic_config(config, "0.3.8")[0] == 240
    assert compute_elastic_config(config, "0.19.6+abc")[0] == 240


def test_v02_reads_world_size_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute_elastic_config({"elasticity": ELASTIC}, "0.19.6")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert compute_elastic_config({"elasticity": ELASTIC}, "0.19.6", return_microbatch=True) == (
        240,
        [1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60],
        4,  # the largest micro batch dividing 240 // 4
    )


def test_hcn_list_is_the_highly_composite_numbers():
    limit = HCN_LIST[-1]
    divisors = np.zeros(limit + 1, dtype=np.int64)
    for d in range(1, limit + 1):
        divisors[d::d] += 1
    record, expected = 0, []
    for n in range(1, limit + 1):
        if divisors[n] > record:
            record = divisors[n]
            expected.append(n)
    assert list(HCN_LIST) == expected


def test_valid_gpus_are_the_counts_with_whole_accumulation_steps():
    batch, micro = 240, [4, 8, 16]
    brute = [n for n in range(1, 241) if any(batch % (m * n) == 0 for m in micro)]
    assert get_valid_gpus(batch, micro, 1, 240) == brute
    assert get_valid_gpus(batch, micro, 3, 12) == [n for n in brute if 3 <= n <= 12]


# ----------------------------------------------------------------------------------------------
# elasticity_enabled, ElasticityConfig, ensure_immutable_elastic_config
# ----------------------------------------------------------------------------------------------


def test_elasticity_enabled():
    assert elasticity_enabled({}) is False
    assert elasticity_enabled({"elasticity": {}}) is False
    assert elasticity_enabled({"elasticity": {"enabled": False}}) is False
    assert elasticity_enabled({"elasticity": ELASTIC}) is True


def test_elasticity_config_uses_deepspeeds_attribute_names():
    config = ElasticityConfig({**ELASTIC, "prefer_larger_batch": False})
    assert config.max_acceptable_batch_size == 256
    assert config.micro_batches == [4, 8, 16]
    assert config.prefer_larger_batch_size is False
    assert (config.min_gpus, config.max_gpus, config.version) == (1, 10000, 0.2)
    assert config.ignore_non_elastic_batch_info is False
    assert json.loads(repr(config))["micro_batches"] == [4, 8, 16]
    disabled = ElasticityConfig({})  # a disabled block falls back to the defaults
    assert (disabled.max_acceptable_batch_size, disabled.micro_batches) == (2000, [2, 4, 6])


def test_ensure_immutable_without_the_variable_only_warns(warnings_log):
    ensure_immutable_elastic_config(ELASTIC)
    assert any(
        constants.DEEPSPEED_ELASTICITY_CONFIG in r.getMessage() for r in warnings_log.records
    )


def test_ensure_immutable_compares_with_the_scheduler(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(constants.DEEPSPEED_ELASTICITY_CONFIG, json.dumps(ELASTIC))
    ensure_immutable_elastic_config({**ELASTIC, "min_gpus": 2})  # min_gpus is not compared
    changed = {**ELASTIC, "micro_batch_sizes": [4, 8]}
    with pytest.raises(
        ElasticityConfigError, match=r"micro_batch_sizes is \[4, 8\] .* \[4, 8, 16\]"
    ):
        ensure_immutable_elastic_config(changed)
    with pytest.raises(ElasticityConfigError, match="version"):
        ensure_immutable_elastic_config({**ELASTIC, "version": 0.1})


# ----------------------------------------------------------------------------------------------
# The config: shardspeed.initialize's batch keys
# ----------------------------------------------------------------------------------------------


def _triple(config: Any) -> tuple[int, int, int]:
    return (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    )


@pytest.mark.parametrize(("block", "world_size", "expected"), GOLDEN_CONFIG)
def test_config_batch_keys_match_deepspeed(
    block: dict[str, Any], world_size: int, expected: tuple[int, int, int]
):
    config = load_config({"elasticity": {"enabled": True, **block}}, dp_world_size=world_size)
    assert _triple(config) == expected


def test_unresolved_config_leaves_the_batch_to_the_world_size():
    config = load_config({"elasticity": ELASTIC, "zero_optimization": {"stage": 2}})
    assert _triple(config) == (None, None, None)
    assert _triple(config.resolve_batch(2)) == (240, 8, 15)
    assert _triple(config.resolve_batch(2).resolve_batch(4)) == (240, 4, 15)


def test_batch_keys_beside_elasticity_are_an_error():
    with pytest.raises(ConfigError) as info:
        load_config(
            {"elasticity": ELASTIC, "train_batch_size": 32, "gradient_accumulation_steps": 2}
        )
    paths = [issue.path for issue in info.value.issues]
    assert paths == ["train_batch_size", "gradient_accumulation_steps"]
    assert "ignore_non_elastic_batch_info" in str(info.value)


def test_ignore_non_elastic_batch_info_ignores_them_with_a_warning(warnings_log):
    elastic = {**ELASTIC, "ignore_non_elastic_batch_info": True}
    config = load_config(
        {"elasticity": elastic, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 3},
        dp_world_size=4,
    )
    assert _triple(config) == (240, 4, 15)
    assert any("train_batch_size=10" in r.getMessage() for r in warnings_log.records)


def test_auto_batch_values_are_filled_by_elasticity():
    config = load_config(
        {"elasticity": ELASTIC, "train_batch_size": "auto", "gradient_accumulation_steps": "auto"},
        dp_world_size=2,
    )
    assert _triple(config) == (240, 8, 15)


def test_incompatible_world_size_is_a_config_error():
    block = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [8], "version": 0.1}
    with pytest.raises(ConfigError, match=r"valid GPU counts are \[1, 2, 3, 6\]") as info:
        load_config({"elasticity": block}, dp_world_size=5)
    assert [issue.path for issue in info.value.issues] == ["elasticity"]
    assert isinstance(info.value.__cause__, ElasticityIncompatibleWorldSize)


@pytest.mark.parametrize(
    ("block", "path"),
    [
        ({"enabled": True, "micro_batch_sizes": [2]}, "elasticity.max_train_batch_size"),
        ({**ELASTIC, "micro_batch_sizes": [0]}, "elasticity.micro_batch_sizes"),
        ({**ELASTIC, "min_gpus": 8, "max_gpus": 4}, "elasticity.min_gpus"),
        ({**ELASTIC, "version": 0.1, "model_parallel_size": 2}, "elasticity.model_parallel_size"),
        ({**ELASTIC, "version": 0.3}, "elasticity.version"),
        ({**ELASTIC, "max_gpus": "many"}, "elasticity.max_gpus"),
        ({**ELASTIC, "min_gpu": 2}, "elasticity.min_gpu"),
    ],
)
def test_invalid_block_is_refused_at_load(block: dict[str, Any], path: str):
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": block})
    assert [issue.path for issue in info.value.issues] == [path], str(info.value)


@pytest.mark.parametrize(
    ("block", "world_size", "path"),
    [
        ({**ELASTIC, "num_gpus_per_node": 6, "model_parallel_size": 4}, 4, "model_parallel_size"),
        (
            {"enabled": True, "max_train_batch_size": 10, "micro_batch_sizes": [4]},
            3,
            "max_train_batch_size",
        ),
    ],
)
def test_world_size_errors_name_the_elasticity_key(
    block: dict[str, Any], world_size: int, path: str
):
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": block}, dp_world_size=world_size)
    assert [issue.path for issue in info.value.issues] == [f"elasticity.{path}"], str(info.value)
    assert "Fix:" in str(info.value)


def test_scheduler_config_mismatch_is_a_config_error(monkeypatch: pytest.MonkeyPatch):
    scheduler = {**ELASTIC, "max_train_batch_size": 512}
    monkeypatch.setenv(constants.DEEPSPEED_ELASTICITY_CONFIG, json.dumps(scheduler))
    with pytest.raises(ConfigError) as info:
        load_config({"elasticity": ELASTIC}, dp_world_size=2)
    assert [issue.path for issue in info.value.issues] == ["elasticity.max_train_batch_size"]


def test_disabled_block_keeps_the_given_batch():
    config = load_config(
        {"elasticity": {"enabled": False, "max_gpus": 4}, "train_batch_size": 8}, dp_world_size=2
    )
    assert _triple(config) == (8, 4, 1)
    assert config.elasticity.enabled is False
    assert "elasticity" not in config.ignored_keys


def test_deepspeed_module_paths():
    import importlib

    for module, names in {
        "shardspeed.elasticity": ("compute_elastic_config", "ElasticityConfigError", "ENABLED"),
        "shardspeed.elasticity.elasticity": ("compute_elastic_config", "elasticity_enabled"),
        "shardspeed.elasticity.config": ("ElasticityConfig", "ElasticityIncompatibleWorldSize"),
        "shardspeed.elasticity.constants": ("ELASTICITY", "DEEPSPEED_ELASTICITY_CONFIG"),
    }.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name), f"{module}.{name}"
