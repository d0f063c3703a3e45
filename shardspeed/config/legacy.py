"""Top-level ds_config keys that ShardSpeed accepts without modelling them.

Nothing is dropped silently: each key below is either *ignored with a warning* naming it, or
*rejected when enabled* (the feature would change training and ShardSpeed does not implement
it), with a message that says what to use instead. A block that is present but disabled
(``"enabled": false``) is ignored with a warning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardspeed.config.base import ConfigError, ConfigIssue, did_you_mean, explain, nested_home
from shardspeed.utils.logging import warning_once

if TYPE_CHECKING:
    from shardspeed.config.base import ConfigModel

STRICT_ENV = "SHARDSPEED_STRICT_CONFIG"
"""Set to 1 to refuse unknown top-level keys (DeepSpeed, and ShardSpeed by default, ignore them)."""


@dataclass(frozen=True)
class UnmodelledKey:
    """How one unmodelled top-level key is handled."""

    reason: str
    fix: str
    reject_when_enabled: bool


UNMODELLED_KEYS: dict[str, UnmodelledKey] = {
    "autotuning": UnmodelledKey(
        "autotuning is not implemented (the search lives in DeepSpeed's launcher)",
        "tune train_micro_batch_size_per_gpu and the ZeRO stage by hand",
        reject_when_enabled=False,
    ),
    "graph_harvesting": UnmodelledKey(
        "graph harvesting (CUDA-graph capture of short kernels) is not implemented",
        "remove the key",
        reject_when_enabled=False,
    ),
    "weight_quantization": UnmodelledKey(
        "inference weight quantization is configured through shardspeed.init_inference",
        "pass the quantization options to init_inference instead",
        reject_when_enabled=False,
    ),
    "amp": UnmodelledKey(
        "NVIDIA Apex AMP is not supported (DeepSpeed also rejects it with ZeRO and fp16)",
        'use "bf16": {"enabled": true} (or "fp16") instead and remove the amp block',
        reject_when_enabled=True,
    ),
    "curriculum_learning": UnmodelledKey(
        "legacy curriculum learning was removed in DeepSpeed 0.19.7 and is not implemented",
        "order or filter samples in your own data loader",
        reject_when_enabled=True,
    ),
    "data_efficiency": UnmodelledKey(
        "data efficiency (curriculum sampling, random-LTD) is not implemented",
        "remove the block or set its enabled to false",
        reject_when_enabled=True,
    ),
    "progressive_layer_drop": UnmodelledKey(
        "progressive layer drop was removed in DeepSpeed 0.19.7 and is not implemented",
        "remove the block",
        reject_when_enabled=True,
    ),
    "quantize_training": UnmodelledKey(
        "quantize-aware training (MoQ) was removed in DeepSpeed 0.19.7 and is not implemented",
        "remove the block",
        reject_when_enabled=True,
    ),
    "eigenvalue": UnmodelledKey(
        "eigenvalue computation was removed in DeepSpeed 0.19.7 and is not implemented",
        "remove the block",
        reject_when_enabled=True,
    ),
    "nebula": UnmodelledKey(
        "the Azure Nebula checkpoint service is not supported",
        "remove the block; checkpoints are written by ShardSpeed's own sharded format",
        reject_when_enabled=True,
    ),
    "datastates": UnmodelledKey(
        "the DataStates asynchronous checkpoint engine is not supported",
        "remove the block",
        reject_when_enabled=True,
    ),
    "expert_parallel": UnmodelledKey(
        "AutoEP (automatic conversion of HF MoE blocks) is not implemented",
        "build the model with shardspeed.moe.MoE layers and set ep_size there",
        reject_when_enabled=True,
    ),
}
"""Accepted-but-unmodelled top-level keys (see the module docstring)."""


def is_enabled(value: Any) -> bool:
    """``true``, or a block with ``"enabled": true`` anywhere inside it."""
    if value is True:
        return True
    if isinstance(value, dict):
        if value.get("enabled") is True:
            return True
        return any(is_enabled(v) for v in value.values() if isinstance(v, dict))
    return False


def split_unmodelled(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Remove the unmodelled keys from ``data``: returns ``(rest, ignored)``.

    Raises:
        ConfigError: listing every unmodelled block that is enabled.
    """
    rest: dict[str, Any] = {}
    ignored: dict[str, Any] = {}
    issues: list[ConfigIssue] = []
    for key, value in data.items():
        entry = UNMODELLED_KEYS.get(key)
        if entry is None:
            rest[key] = value
        elif entry.reject_when_enabled and is_enabled(value):
            issues.append(ConfigIssue(key, explain(entry.reason, value, fix=entry.fix)))
        else:
            ignored[key] = value
            warning_once(f"ds_config key '{key}' is accepted but ignored: {entry.reason}.")
    if issues:
        raise ConfigError.from_issues(issues)
    return rest, ignored


def _unknown_hint(owner: type[ConfigModel], key: str) -> str:
    """What an unknown top-level ``key`` most likely meant, as a sentence fragment."""
    head, dot, tail = key.partition(".")
    if dot and head in owner.known_keys():
        # TRL and others write nested keys as dotted top-level names: DeepSpeed ignores them
        return (
            f"it looks like the nested key '{head}.{tail}', but a dotted top-level name is not "
            f'nested; to set it write {{"{head}": {{"{tail}": ...}}}}'
        )
    home = nested_home(owner, key)
    if home is not None:
        return f"this key belongs inside a block: did you mean '{home}'?"
    guess = did_you_mean(key, owner.known_keys())
    if guess is not None:
        return f"did you mean '{guess}'?"
    return "remove it or correct the spelling"


def split_unknown(
    owner: type[ConfigModel], data: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Remove the top-level keys ``owner`` does not know: returns ``(rest, unknown)``.

    DeepSpeed ignores unknown top-level keys, and frameworks rely on it (TRL's
    ``prepare_deepspeed`` adds ``"zero_optimization.reduce_bucket_size"`` at the top level), so
    each one is ignored with one warning naming it and what it looks like. With
    ``SHARDSPEED_STRICT_CONFIG=1`` they are refused instead.

    Raises:
        ConfigError: in strict mode, listing every unknown key.
    """
    known = owner.known_keys()
    rest = {key: value for key, value in data.items() if key in known}
    unknown = {key: value for key, value in data.items() if key not in known}
    strict = os.environ.get(STRICT_ENV, "0").strip().lower() in ("1", "true", "yes")
    if strict and unknown:
        raise ConfigError.from_issues(
            [
                ConfigIssue(key, explain("unknown key", value, fix=_unknown_hint(owner, key)))
                for key, value in unknown.items()
            ]
        )
    for key in unknown:
        warning_once(
            f"ds_config top-level key '{key}' is unknown and ignored, as DeepSpeed ignores it "
            f"({_unknown_hint(owner, key)}); set {STRICT_ENV}=1 to make unknown keys errors"
        )
    return rest, unknown
